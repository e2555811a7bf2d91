import os

import pytest
import torch
from safetensors.torch import save_file

from peer.state import checkpoint as ckpt
from peer.state.checkpoint import PeerState, fetch_residuals, load_checkpoint, restore_extras, save_checkpoint
from peer.train.data import BatchSampler
from protocol.errors import CheckpointError

NAMES = ["a.weight", "b.bias"]
SHAPES = [torch.Size([3, 2]), torch.Size([4])]
STREAM = torch.arange(1_000, dtype=torch.int16)


def sampler(seed=7):
    return BatchSampler(STREAM, seq_len=8, batch_sequences=2, seed=seed)


def make_state(round_=3, fill=1.0, residuals=True):
    t = [torch.full(s, fill) for s in SHAPES]
    data = sampler()
    for _ in range(round_):
        data.next_batch()
    return PeerState(
        run_id="r" * 32,
        round=round_,
        inner_step=round_ * 5 + 2,
        round_step=2,
        round_tokens=512,
        names=NAMES,
        phi=t,
        momentum=[x * 2 for x in t],
        theta=[x * 3 for x in t],
        adam_exp_avg=[x * 4 for x in t],
        adam_exp_avg_sq=[x * 5 for x in t],
        adam_step=17,
        residuals=[x * 6 for x in t] if residuals else None,
        data=data.state(),
    )


def load(path):
    return load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES)


def test_round_trip_drops_nothing(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    state = load(path)
    assert (state.round, state.inner_step, state.round_step, state.round_tokens, state.adam_step) == (3, 17, 2, 512, 17)
    for group, factor in (
        ("phi", 1),
        ("momentum", 2),
        ("theta", 3),
        ("adam_exp_avg", 4),
        ("adam_exp_avg_sq", 5),
        ("residuals", 6),
    ):
        for tensor, shape in zip(getattr(state, group), SHAPES):
            assert torch.equal(tensor, torch.full(shape, float(factor))), group
    assert state.upgrade_note is None
    # the data position: a sampler restored from it draws what the saved one would have drawn next
    assert (state.data.seed, state.data.batches_drawn) == (7, 3)
    uninterrupted, restored = sampler(), sampler()
    for _ in range(3):
        uninterrupted.next_batch()
    restored.load_state(state.data)
    assert torch.equal(restored.next_batch(), uninterrupted.next_batch())


def test_residuals_are_optional(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state(residuals=False))
    state = load(path)
    assert state.residuals is None and state.adam_exp_avg is not None and state.data.batches_drawn == 3


def test_a_partial_or_malformed_group_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    tensors = ckpt.load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    del tensors["residual.b.bias"]
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="lacks tensor residual.b.bias"):
        load(path)
    tensors["residual.b.bias"] = torch.zeros(4)
    tensors["data.rng"] = torch.zeros(3, 3)
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match="data.rng is torch.float32"):
        load(path)


def test_a_format_1_checkpoint_resumes_what_it_holds_with_a_note(tmp_path):
    """Written as format 1 did (no residuals, no data position): it loads, and says what it lacked."""
    path = tmp_path / "c.safetensors"
    tensors = {
        f"{group}.{name}": torch.full(shape, float(i))
        for i, group in enumerate(("phi", "momentum", "theta", "adam_exp_avg", "adam_exp_avg_sq"))
        for name, shape in zip(NAMES, SHAPES)
    }
    save_file(
        tensors,
        str(path),
        metadata={
            "format": "1",
            "run_id": "r" * 32,
            "round": "4",
            "inner_step": "20",
            "round_step": "0",
            "round_tokens": "0",
            "adam_step": "20",
            "names": ",".join(NAMES),
        },
    )
    state = load(path)
    assert (state.round, state.adam_step) == (4, 20) and torch.equal(state.theta[1], torch.full((4,), 2.0))
    assert state.residuals is None and state.data is None
    assert "format 1" in state.upgrade_note and "no data position" in state.upgrade_note
    fresh = sampler()
    taken, problems = restore_extras(state, load_residuals=lambda r: pytest.fail("no residuals to load"), sampler=fresh)
    assert taken == 0 and problems == [state.upgrade_note] and fresh.batches_drawn == 0


def test_an_unknown_format_is_refused_naming_it(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    tensors = ckpt.load_file(str(path))
    save_file(tensors, str(path), metadata={"format": "9", "run_id": "r" * 32})
    with pytest.raises(CheckpointError, match="format '9', expected 2"):
        load(path)


def test_restore_extras_hands_residuals_and_data_position_to_their_owners(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    state = load(path)
    received = []
    target = sampler()
    taken, problems = restore_extras(state, load_residuals=lambda r: received.append(r) or len(r), sampler=target)
    assert taken == 2 and problems == [] and target.batches_drawn == 3
    assert torch.equal(received[0][1], torch.full((4,), 6.0))

    def refuse(residuals):
        raise ValueError("2 residual tensors, expected 3")

    other_seed = sampler(seed=8)
    taken, problems = restore_extras(state, load_residuals=refuse, sampler=other_seed)
    assert taken == 0 and other_seed.batches_drawn == 0
    assert "residuals not restored" in problems[0] and "expected 3" in problems[0]
    assert "data position not restored" in problems[1] and "seed 7" in problems[1]


def test_fetch_residuals_reports_an_averager_that_does_not_answer():
    assert fetch_residuals(lambda: None) == (None, None)

    def silent():
        raise TimeoutError()

    residuals, problem = fetch_residuals(silent)
    assert residuals is None and "lacks the error-feedback residuals" in problem


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state(round_=1))

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(CheckpointError, match="previous one is intact"):
        save_checkpoint(path, make_state(round_=2, fill=9.0))
    monkeypatch.undo()
    assert load(path).round == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left


def test_truncated_file_is_an_actionable_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES)


def test_other_run_or_model_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, make_state())
    with pytest.raises(CheckpointError, match="belongs to run"):
        load_checkpoint(path, run_id="x" * 32, names=NAMES, shapes=SHAPES)
    with pytest.raises(CheckpointError, match="different model"):
        load_checkpoint(path, run_id="r" * 32, names=["other"], shapes=SHAPES[:1])
    assert os.path.exists(path)


WRITER = """
import sys, torch
sys.path.insert(0, {root!r})
from peer.state.checkpoint import PeerState, save_checkpoint
from peer.train.data import BatchSampler
shape = torch.Size([256, 256])
data = BatchSampler(torch.arange(1_000, dtype=torch.int16), seq_len=8, batch_sequences=2, seed=7)
for i in range(10**9):
    t = [torch.full(shape, float(i))]
    save_checkpoint({path!r}, PeerState(run_id="r" * 32, round=i, inner_step=i, round_step=0, round_tokens=0,
                                        names=["w"], phi=t, momentum=t, theta=t, adam_exp_avg=t,
                                        adam_exp_avg_sq=t, adam_step=i, residuals=t, data=data.state()))
    print(i, flush=True)
    data.next_batch()
"""


def test_kill_9_during_writes_never_leaves_a_torn_checkpoint(tmp_path):
    """A writer process saving in a loop is SIGKILLed at random moments; every time, the file on
    disk loads and is one whole round: every tensor (φ, outer state, θ, AdamW, residuals), AdamW's
    step and the data position are of the same round, never a torn mix."""
    import random
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    path = tmp_path / "c.safetensors"
    rng = random.Random(0)
    for trial in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER.format(root=root, path=str(path))], stdout=subprocess.PIPE, text=True
        )
        for _ in range(1 + trial):  # let it finish a few writes, so a kill can land mid-write
            assert proc.stdout.readline(), "writer died"
        time_ms = rng.uniform(0, 40)
        try:
            proc.wait(timeout=time_ms / 1000)
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        state = load_checkpoint(path, run_id="r" * 32, names=["w"], shapes=[torch.Size([256, 256])])
        value = float(state.phi[0][0, 0])
        tensors = (state.phi, state.momentum, state.theta, state.adam_exp_avg, state.adam_exp_avg_sq, state.residuals)
        assert all(float(group[0].min()) == float(group[0].max()) == value for group in tensors)
        assert state.round == state.adam_step == state.data.batches_drawn == int(value)
        # the data position is that round's: a sampler restored from it draws batch round + 1
        restored, uninterrupted = sampler(), sampler()
        restored.load_state(state.data)
        for _ in range(state.round):
            uninterrupted.next_batch()
        assert torch.equal(restored.next_batch(), uninterrupted.next_batch())
    # the next write clears what the killed writes left behind
    save_checkpoint(path, make_state())
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_the_ledger_of_vouchers_survives_a_restart(tmp_path):
    import dataclasses
    import json

    from peer.state.vouching import Ledger

    ledger = Ledger()
    ledger.record_group(4, ["12D3KooWa", "12D3KooWb"])
    ledger.record_group(2, ["12D3KooWb"])
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, dataclasses.replace(make_state(), vouchers=ledger.as_dict()))
    restored = Ledger()
    restored.load(load(path).vouchers)
    assert restored.vouchers(5) == {"12D3KooWa", "12D3KooWb"} and restored.vouchers(3) == {"12D3KooWb"}
    save_checkpoint(path, make_state())  # none saved: none loaded
    assert load(path).vouchers is None
    for bad in ('["x"]', '{"p": -1}', '{"p": "3"}', '{"p": true}', "{"):
        save_checkpoint(path, make_state())
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata())
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta["vouchers"] = bad
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(CheckpointError, match="malformed metadata"):
            load(path)
    with pytest.raises(ValueError, match="expected a peer id"):
        Ledger().load({"": 1})
    assert json.loads(json.dumps(ledger.as_dict())) == {"12D3KooWa": 4, "12D3KooWb": 2}


def test_the_measured_loss_of_phi_survives_a_restart_and_a_malformed_one_is_refused(tmp_path):
    import dataclasses

    from safetensors import safe_open

    path = tmp_path / "c.safetensors"
    save_checkpoint(path, dataclasses.replace(make_state(), phi_eval=("ab" * 16, 2.25)))
    assert load(path).phi_eval == ("ab" * 16, 2.25)
    save_checkpoint(path, make_state())  # none measured: none loaded
    assert load(path).phi_eval is None
    for digest, loss in (("ab" * 16, None), ("xy", "1.0"), ("ab" * 16, "nan"), ("ab" * 16, "-1"), ("", "1.0")):
        save_checkpoint(path, make_state())
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata())
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta.update({"phi_eval_digest": digest} | ({} if loss is None else {"phi_eval_loss": loss}))
        save_file(tensors, str(path), metadata=meta)
        with pytest.raises(CheckpointError, match="malformed metadata"):
            load(path)


def test_the_background_writer_writes_in_order_and_reports_a_failed_write_on_the_callers_thread(tmp_path, monkeypatch):
    from peer.state.checkpoint import CheckpointWriter, encode_checkpoint

    path = tmp_path / "c.safetensors"
    writer = CheckpointWriter()
    state = make_state(round_=1)
    file = encode_checkpoint(state)
    state.phi[0].fill_(123.0)  # the encoded copy does not follow the live tensors
    writer.submit(path, file)
    writer.submit(path, encode_checkpoint(make_state(round_=2)))
    writer.flush()
    assert load(path).round == 2  # the newer write landed last

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    writer.submit(path, encode_checkpoint(make_state(round_=3, fill=9.0)))
    with pytest.raises(CheckpointError, match="No space left on device; the previous one is intact"):
        writer.flush()  # the failure surfaces on the round loop's thread
    monkeypatch.undo()
    assert load(path).round == 2
    writer.flush()  # nothing pending: the failed write was reported once
    exported = []
    writer.submit(path, encode_checkpoint(make_state(round_=4)))
    writer.submit_call(lambda: exported.append(load(path).round))  # queued behind the write, in order
    writer.flush()
    assert exported == [4]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
