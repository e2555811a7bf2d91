"""``inner_optimizer.kind = "muon"``: Muon on the transformer blocks' matrices, AdamW on the rest
(peer/train/inner.py :class:`MuonAdamW`), checked against torch's own two optimizers stepped by hand."""

import copy
import dataclasses

import pytest
import torch

from peer.train.inner import InnerLoop, MuonAdamW, muon_matrices
from peer.train.model import build_model
from peer.train.precision import FP16
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import RunManifest, from_dict
from protocol.presets import tiny_run
from tests.unit.samplers import Fixed

RUN = tiny_run().replace(model={"num_layers": 2})


def spec(**kw):
    return dataclasses.replace(RUN.inner_optimizer, kind="muon", muon_lr_ratio=4.0, **kw)


def batch(rows=8, seed=0):
    return torch.randint(0, 256, (rows, RUN.data.seq_len_tokens + 1), generator=torch.Generator().manual_seed(seed))


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    model = build_model(RUN.model)
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = [names[id(p)] for p in muon_matrices(model)]
    assert matrices and all(".layers." in n and n.endswith("proj.weight") for n in matrices)
    assert len(matrices) == 7 * RUN.model.num_layers  # q, k, v, o, gate, up, down per block
    loop = InnerLoop(model, spec(), Fixed(batch()))
    assert isinstance(loop.optimizer, MuonAdamW) and not loop.fused
    adamw = {names[id(p)] for g in loop.optimizer.adamw.param_groups for p in g["params"]}
    assert "model.embed_tokens.weight" in adamw and not adamw & set(matrices)
    assert len(adamw) + len(matrices) == len(loop.params)


def test_steps_equal_torchs_muon_and_adamw_stepped_by_hand():
    s = spec()
    model = build_model(RUN.model)
    reference = copy.deepcopy(model)
    loop = InnerLoop(model, s, Fixed(batch()))
    ref_matrices = {id(p) for p in muon_matrices(reference)}
    ref_params = list(reference.parameters())
    adamw = torch.optim.AdamW(
        [p for p in ref_params if id(p) not in ref_matrices],
        lr=s.lr,
        betas=(s.beta1, s.beta2),
        eps=s.eps,
        weight_decay=s.weight_decay,
    )
    muon = torch.optim.Muon(
        [p for p in ref_params if id(p) in ref_matrices],
        lr=s.lr * s.muon_lr_ratio,
        weight_decay=s.weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    from peer.train.model import lm_loss

    for k in range(3):  # 3 steps: a gradient left over from a step (zero_grad missing Muon's) would show
        loop.step(k)
        adamw.zero_grad(set_to_none=True)
        muon.zero_grad(set_to_none=True)
        lm_loss(reference, batch()).backward()
        torch.nn.utils.clip_grad_norm_(ref_params, s.grad_clip_norm)
        for group in adamw.param_groups:
            group["lr"] = loop.lr(k)
        for group in muon.param_groups:
            group["lr"] = loop.lr(k) * s.muon_lr_ratio
        adamw.step()
        muon.step()
    for p, q in zip(loop.params, ref_params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    moved = [not torch.equal(p, q) for p, q in zip(loop.params, build_model(RUN.model).parameters())]
    assert all(moved)


def test_a_checkpoint_round_trip_continues_identically_and_keeps_adamws_layout():
    a = InnerLoop(build_model(RUN.model), spec(), Fixed(batch()))
    assert a.state_dict() is None
    for k in range(2):
        a.step(k)
    state = a.state_dict()
    matrices = {id(p) for p in muon_matrices(a.model)}
    assert state["step"] == 2 and len(state["exp_avg"]) == len(a.params)
    for p, m1, m2 in zip(a.params, state["exp_avg"], state["exp_avg_sq"]):
        assert m1.shape == m2.shape == p.shape and m1.dtype == torch.float32
        if id(p) in matrices:  # Muon's momentum buffer; no second moment
            assert m1 is a.optimizer.muon.state[p]["momentum_buffer"] and not m2.any()
    b = InnerLoop(copy.deepcopy(a.model), spec(), Fixed(batch(seed=1)))
    b.load_state_dict(state)
    a.sampler = Fixed(batch(seed=1))
    a.step(2)
    b.step(2)
    for x, y in zip(a.params, b.params):
        assert torch.equal(x, y)  # same momentum and moments: the same update, bit for bit
    b.reset_optimizer()
    assert b.state_dict() is None and not b.optimizer.muon.state and not b.optimizer.adamw.state


def test_fp16_with_a_gradient_scaler_unscales_and_steps_both():
    loop = InnerLoop(build_model(RUN.model), spec(), Fixed(batch()), precision=FP16)
    losses = [loop.step(k).loss for k in range(8)]
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in loop.params)
    loop.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # an overflow skips both updates
    before = [p.detach().clone() for p in loop.params]
    loop.step(8)
    assert all(torch.equal(p, q) for p, q in zip(loop.params, before))


def test_the_manifest_field_validates_encodes_and_refuses_what_cannot_run_it():
    base = RunManifest(name="t")
    assert "kind" not in base.to_dict()["inner_optimizer"]  # left out at AdamW: existing run ids unchanged
    muon = base.replace(inner_optimizer={"kind": "muon"})
    assert muon.to_dict()["inner_optimizer"]["kind"] == "muon" and muon.run_id != base.run_id
    assert from_dict(muon.to_dict()) == muon
    assert muon.replace(inner_optimizer={"muon_lr_ratio": 2.0}).run_id != muon.run_id
    with pytest.raises(ManifestError, match=r"inner_optimizer.kind = 'sgd' is invalid: allowed one of 'adamw', 'muon'"):
        base.replace(inner_optimizer={"kind": "sgd"})
    with pytest.raises(ManifestError, match=r"inner_optimizer.muon_lr_ratio = -1"):
        base.replace(inner_optimizer={"kind": "muon", "muon_lr_ratio": -1.0})
    with pytest.raises(ManifestError, match=r"inner_optimizer.kind = 'muon' is invalid: allowed 'adamw' with pipeline"):
        base.replace(inner_optimizer={"kind": "muon"}, pipeline={"stages": 2})


def test_a_model_without_blocks_and_several_devices_are_refused():
    with pytest.raises(ConfigError, match="needs a model with transformer blocks"):
        InnerLoop(torch.nn.Sequential(torch.nn.Embedding(8, 4)), spec(), Fixed(batch()))
    from peer.train.ddp import DistributedInnerLoop

    with pytest.raises(ConfigError, match="kind = 'adamw' only, and this run's is 'muon'"):
        DistributedInnerLoop.launch(build_model(RUN.model), spec(), Fixed(batch()), devices=["cpu", "cpu"])
