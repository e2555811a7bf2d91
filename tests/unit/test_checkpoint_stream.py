"""peer/state/safetensors_stream.py writes a safetensors file tensor by tensor from the tensors as
held (issue #67, item 2): the file loads with safetensors as one written by its own ``save_file``,
a writer killed in the middle leaves the previous checkpoint as it was, and the writer never holds
more than one tensor's copy."""

from __future__ import annotations

import signal
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import peer.state.safetensors_stream as stream
from peer.state.checkpoint import PeerState, encode_checkpoint, load_checkpoint, save_checkpoint, write_checkpoint

NAMES = ["embed", "block.w", "norm"]
SHAPES = [torch.Size([40, 8]), torch.Size([8, 8]), torch.Size([8])]


def state(value: float, **overrides) -> PeerState:
    def group(k: int) -> list[torch.Tensor]:
        return [torch.full(shape, value + k) + torch.arange(shape.numel()).reshape(shape) for shape in SHAPES]

    fields = dict(
        run_id="r" * 32,
        round=int(value),
        inner_step=3,
        round_step=1,
        round_tokens=640,
        names=NAMES,
        phi=group(0),
        momentum=group(1),
        theta=group(2),
        adam_exp_avg=group(3),
        adam_exp_avg_sq=group(4),
        adam_step=7,
        residuals=group(5),
        vouchers={"12D3KooWa": 2},
    )
    fields.update(overrides)
    return PeerState(**fields)


def test_a_streamed_file_loads_with_safetensors_bit_for_bit(tmp_path):
    tensors = {
        "f32": torch.randn(5, 3),
        "f32.view": torch.randn(6, 4)[:, 1:3],  # not contiguous: written contiguous
        "f16": torch.randn(7).to(torch.float16),  # a float: written as fp32
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "u8": torch.arange(256, dtype=torch.uint8),
        "i64": torch.tensor([-(2**40), 3]),
        "bool": torch.tensor([True, False, True]),
    }
    metadata = {"format": "2", "names": "a,b", "ünïcode": "φ θ"}
    path = tmp_path / "x.safetensors"
    stream.save_atomically(path, tensors, metadata, first=("u8",))
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        want = t.to(torch.float32) if t.is_floating_point() else t
        assert loaded[name].dtype == want.dtype and loaded[name].shape == want.shape, name
        assert torch.equal(loaded[name], want), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == metadata
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0  # the data starts 8-byte aligned


def test_a_checkpoint_round_trips_every_tensor_and_field(tmp_path):
    path = tmp_path / "c.safetensors"
    written = state(1.0)
    save_checkpoint(path, written)
    loaded = load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES)
    for group in ("phi", "momentum", "theta", "adam_exp_avg", "adam_exp_avg_sq", "residuals"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(loaded, group), getattr(written, group), strict=True))
    assert (loaded.round, loaded.inner_step, loaded.round_step, loaded.round_tokens, loaded.adam_step) == (
        1,
        3,
        1,
        640,
        7,
    )
    assert loaded.vouchers == {"12D3KooWa": 2}


def test_the_writer_holds_at_most_one_tensors_copy(tmp_path, monkeypatch):
    """Every tensor the writer writes passes through ``host_bytes``; a copy it makes (a tensor not
    already fp32 contiguous on the host) must be gone before the next is made."""
    alive, most, copies = [0], [0], [0]
    real = stream.host_bytes

    def counted(t: torch.Tensor) -> torch.Tensor:
        out = real(t)
        if out.data_ptr() != t.data_ptr() or out.dtype != t.dtype:
            alive[0] += 1
            copies[0] += 1
            most[0] = max(most[0], alive[0])
            weakref.finalize(out, lambda: alive.__setitem__(0, alive[0] - 1))
        return out

    monkeypatch.setattr(stream, "host_bytes", counted)
    # every group needs a conversion: half precision and strided views of bigger tensors
    half = state(2.0)
    for group in ("phi", "momentum", "theta", "adam_exp_avg", "adam_exp_avg_sq", "residuals"):
        setattr(half, group, [t.to(torch.bfloat16) for t in getattr(half, group)])
    half.theta = [torch.stack([t.float(), t.float()], dim=-1)[..., 0] for t in half.phi]  # fp32, strided
    assert not any(t.is_contiguous() for t in half.theta)
    file = encode_checkpoint(half, private=("phi", "momentum", "theta", "adam_exp_avg", "adam_exp_avg_sq", "residual"))
    write_checkpoint(tmp_path / "c.safetensors", file)
    assert copies[0] == 6 * len(NAMES)  # each converted once, when written
    assert most[0] == 1
    # fp32 host tensors are written from their own memory: no copy at all
    copies[0] = 0
    write_checkpoint(tmp_path / "d.safetensors", encode_checkpoint(state(3.0), private=("phi", "momentum", "theta")))
    assert copies[0] == 0  # (the groups not named private were copied by encode_checkpoint, as fp32)


WRITER = """
import os, sys, torch
sys.path.insert(0, {root!r})
import peer.state.safetensors_stream as stream
from tests.unit.test_checkpoint_stream import state
from peer.state.checkpoint import save_checkpoint
real = stream._write_one
count = [0]

def stalls_after_two(f, t):
    real(f, t)
    count[0] += 1
    if count[0] == 2:
        f.flush()
        print("mid", flush=True)
        sys.stdin.read()  # killed here, half the tensors in the file

stream._write_one = stalls_after_two
save_checkpoint({path!r}, state(2.0))
print("finished", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    root = str(Path(__file__).resolve().parents[2])
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, state(1.0))
    before = path.read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(root=root, path=str(path))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "mid\n"
        partial = tmp_path / f".c.safetensors.tmp{proc.pid}" / "c.safetensors"
        assert partial.stat().st_size > 0  # the new file is under way, beside the checkpoint
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    assert path.read_bytes() == before
    loaded = load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES)
    assert loaded.round == 1 and torch.equal(loaded.theta[0], state(1.0).theta[0])
    # the next write lands whole and clears what the killed one left
    save_checkpoint(path, state(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]
    assert load_checkpoint(path, run_id="r" * 32, names=NAMES, shapes=SHAPES).round == 3


def test_the_memory_arithmetic_counts_one_tensors_copy_for_a_checkpoint_not_the_models():
    from peer.state.memory_need import CHECKPOINT, PEER, memory_need
    from peer.train.model import build_model
    from peer.train.tokenizer import byte_tokenizer
    from protocol.presets import default_run

    manifest = default_run().replace(compression={"codec": "none"})  # no residuals to fetch
    model = build_model(manifest.model, byte_tokenizer())
    largest = max(p.numel() for p in model.parameters()) * 4
    for device, want in (("cpu", 0), ("cuda", largest)):
        need = memory_need(manifest, device_type=device)
        # what writing one adds (the "checkpoint: ..." buffers); a blocking run's older snapshot is
        # counted at that moment too, but it is held, not made, by the checkpoint
        added = sum(
            b.bytes
            for b in need.buffers
            if b.when == CHECKPOINT and b.process == PEER and b.name.startswith("checkpoint:")
        )
        assert added == want, device
