"""A restarted peer resumes everything its checkpoint holds: error-feedback residuals (which live in
the averager process) and its data position included; a peer that adopts the swarm's state drops
its residuals. Real peer processes on loopback."""

import json
import signal

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID
from safetensors import safe_open

from peer.sync.suspicion_store import GROUPMATES_FILE, SUSPECTS_FILE
from peer.sync.transport import NetworkTransport
from tests.integration.harness import make_manifest, write_manifest

pytestmark = pytest.mark.integration


def read_checkpoint(path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def residuals_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.startswith("residual.")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_residuals_travel_to_the_averager_process_and_back(tmp_path, dtype):
    """NetworkTransport sets and fetches the residuals in the averager process (a real one), kept
    in the run's ``compression.residual_dtype`` (a checkpoint's fp32 residuals load into bf16 ones);
    a reset (what an adoption does) leaves none to checkpoint. The groupmates a peer left out or
    named before its restart, kept in its run directory, are recalled by the new one."""
    manifest = make_manifest(compression={"codec": "int8", "residual_dtype": dtype})
    kept = torch.float32 if dtype == "fp32" else torch.bfloat16
    shapes = [torch.Size([3, 2]), torch.Size([4])]
    liar = PeerID(bytes([0x12, 0x20]) + bytes(range(32)))
    (tmp_path / GROUPMATES_FILE).write_text(json.dumps({"version": 1, "equivocators": {str(liar): 1_000_009}}))
    (tmp_path / SUSPECTS_FILE).write_text(json.dumps({"version": 1, "suspects": {str(liar): 108}}))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    transport = None
    try:
        transport = NetworkTransport(
            dht, shapes, shapes, manifest.run_id, manifest.sync, compression=manifest.compression, memory_dir=tmp_path
        )
        assert transport.suspects.named(9) == [str(liar)]
        assert transport.averager._distrust.ignored(9) == {liar}  # the state its process was forked with
        assert transport.error_feedback_residuals() is None  # no sync yet: nothing to save
        saved = [torch.randn(3, 2), torch.randn(4)]
        assert transport.load_error_feedback(saved) == 2
        for got, want in zip(transport.error_feedback_residuals(), saved):
            assert got.dtype == kept and torch.equal(got, want.to(kept))
        with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
            transport.load_error_feedback([torch.ones(3, 3), torch.ones(4)])
        assert torch.equal(transport.error_feedback_residuals()[1], saved[1].to(kept))  # unchanged by the refusal
        transport.reset_error_feedback()
        assert transport.error_feedback_residuals() is None
    finally:
        if transport is not None:
            transport.shutdown()
        dht.shutdown()


def test_a_restarted_lossy_peer_resumes_its_residuals_and_data_position(procs, tmp_path):
    H = 200  # b alone takes seconds a round: it cannot outrun the restarted peer's state download
    manifest = make_manifest(compression={"codec": "int8"}, sync={"inner_steps": H})
    run_file = write_manifest(tmp_path, manifest)
    _, addr = procs.bootstrap(run_file)
    a, b = (procs.peer(n, "--initial-peers", addr, "--wait-for-peers", "2") for n in ("a", "b"))
    a.wait_event(lambda e: e.get("event") == "round" and e["round"] >= 2 and e["group_size"] == 2, 240)
    a.popen.send_signal(signal.SIGINT)  # b trains on alone
    assert a.wait(60) == 130, a.tail()
    checkpoint = a.of("stopped")[-1]["checkpoint"]
    meta, tensors = read_checkpoint(checkpoint)
    residuals = residuals_of(tensors)
    names = meta["names"].split(",")
    assert meta["format"] == "2" and sorted(residuals) == sorted(f"residual.{n}" for n in names)
    assert any(r.abs().sum() > 0 for r in residuals.values())  # int8 dropped something: a residual is kept
    round_, round_step, drawn = int(meta["round"]), int(meta["round_step"]), int(meta["batches_drawn"])
    assert drawn >= round_ * H + round_step  # every inner step drew a batch

    # Restarted alone (its own DHT: no sync, so the residuals stay as restored): it takes them back
    # into its averager process and continues its data sequence.
    alone = procs.peer("a", "--run", str(run_file), "--max-rounds", str(round_ + 1))
    assert alone.wait(180) == 0, alone.tail()
    resumed = alone.of("resumed")[0]
    assert (resumed["round"], resumed["round_step"]) == (round_, round_step)
    assert (resumed["residuals"], resumed["batches_drawn"]) == (len(names), drawn)
    assert not alone.of("warning"), alone.of("warning")
    meta2, tensors2 = read_checkpoint(checkpoint)
    assert int(meta2["round"]) == round_ + 1
    assert int(meta2["batches_drawn"]) == drawn + (H - round_step)  # no batch replayed, none skipped
    for key, residual in residuals.items():  # out of the averager process into the checkpoint, bit for bit
        assert torch.equal(tensors2[key], residual), key

    # Restarted into the swarm, which moved on: it adopts b's state, drops the residuals of its own φ
    # and checkpoints without them (max-rounds already reached: it stops after the adoption).
    b.wait_event(lambda e: e.get("event") == "round" and e["round"] >= round_ + 2, 240)
    joined = procs.peer("a", "--initial-peers", addr, "--max-rounds", "1")
    assert joined.wait(180) == 0, joined.tail()
    assert joined.of("resumed")[0]["residuals"] == len(names)
    adopted = joined.of("adopted_state")[-1]  # b may move on during a download: then it adopts again
    assert adopted["round"] >= round_ + 2
    meta3, tensors3 = read_checkpoint(checkpoint)
    assert int(meta3["round"]) == adopted["round"]
    assert residuals_of(tensors3) == {}
    assert int(meta3["batches_drawn"]) == int(meta2["batches_drawn"])  # its data position is its own: kept
