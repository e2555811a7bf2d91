"""Error feedback: the sum of decoded updates stays within one residual; stage, commit, rollback."""

import pytest
import torch

from peer.sync.error_feedback import RESIDUAL_DTYPES, ErrorFeedback, SyncFeedback
from protocol.codecs import Codec, decode
from protocol.errors import ManifestError
from protocol.manifest import CompressionSpec
from protocol.wire.pieces import Piece


def _feedback_gap(
    name: str, rounds: int, use_feedback: bool, dtype: torch.dtype = torch.float32
) -> tuple[float, float, float]:
    """(|Σ inputs − Σ decoded|, |Σ inputs|, |last residual|) after ``rounds`` rounds."""
    shape = (48, 40)
    codec = Codec(name, topk_fraction=0.02, rank=2, block_size=64)
    ef = ErrorFeedback([shape], dtype)
    g = torch.Generator().manual_seed(1)
    drift = torch.randn(shape, generator=g) * 0.5  # a steady direction, as pseudo-gradients have
    total_in, total_out = torch.zeros(shape), torch.zeros(shape)
    for t in range(rounds):
        x = drift + torch.randn(shape, generator=g)
        c = ef.compensate(0, x) if use_feedback else x
        y = decode(codec.encode(c, seed=t), shape, seed=t)
        ef.stage(0, c, y)
        ef.commit()
        total_in += x
        total_out += y
    return float((total_in - total_out).norm()), float(total_in.norm()), float(ef.state_tensors()[0].norm())


@pytest.mark.parametrize("name", ["topk", "lowrank", "int4"])
def test_error_feedback_keeps_the_sum_of_decoded_updates_within_one_residual(name):
    gap_50, _, _ = _feedback_gap(name, 50, True)
    gap_200, total_200, residual = _feedback_gap(name, 200, True)
    assert gap_200 == pytest.approx(residual, rel=1e-4)  # Σ inputs − Σ decoded is the residual
    assert gap_200 < 2.5 * gap_50  # bounded, while Σ inputs grew 4x
    assert gap_200 < 0.3 * total_200
    no_feedback_gap, _, _ = _feedback_gap(name, 200, False)
    assert no_feedback_gap > 2 * gap_200  # without it, the dropped part piles up


@pytest.mark.parametrize("name", ["topk", "int8"])
def test_bf16_residuals_lose_only_their_rounding(name):
    """Residuals kept in bf16 (``compression.residual_dtype``): half the memory; each staged residual
    is rounded to bf16 and that rounding (≤ 2⁻⁹ of it) is not carried, so Σ inputs − Σ decoded
    drifts from the residual by at most the rounds' roundings, and stays far below no feedback."""
    gap, total, residual = _feedback_gap(name, 200, True, torch.bfloat16)
    exact, _, _ = _feedback_gap(name, 200, True)
    no_feedback_gap, _, _ = _feedback_gap(name, 200, False)
    assert abs(gap - residual) <= 200 * 2**-8 * residual + 1e-6
    assert gap < 0.3 * total and no_feedback_gap > 2 * gap
    assert gap == pytest.approx(exact, rel=0.1)


def test_bf16_residuals_are_kept_in_bf16_and_compensate_in_fp32():
    ef = ErrorFeedback([(4, 2)], torch.bfloat16)
    c = ef.compensate(0, torch.full((4, 2), 1.0 + 2**-10))
    ef.stage(0, c, torch.zeros(4, 2))
    ef.commit()
    assert ef.state_tensors()[0].dtype == torch.bfloat16 and ef.residuals()[0].dtype == torch.bfloat16
    assert torch.equal(ef.residuals()[0], torch.ones(4, 2, dtype=torch.bfloat16))  # rounded when staged
    out = ef.compensate(0, torch.full((4, 2), 2**-12))
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((4, 2), 1.0 + 2**-12))
    fp32 = ErrorFeedback([(4, 2)])  # a checkpoint's residuals load into either
    fp32.load_residuals(ef.residuals())
    assert fp32.residuals()[0].dtype == torch.float32
    ef.load_residuals([torch.full((4, 2), 3.0)])
    assert ef.residuals()[0].dtype == torch.bfloat16 and ef.residuals()[0][0, 0] == 3.0


def test_error_feedback_commit_rollback_and_rows():
    ef = ErrorFeedback([(6, 2), (3,)])
    assert [t.abs().sum().item() for t in ef.state_tensors()] == [0.0, 0.0]
    x = torch.ones(2, 2)
    c = ef.compensate(0, x, rows=slice(2, 4))
    ef.stage(0, c, torch.zeros(2, 2), rows=slice(2, 4))
    ef.rollback()
    assert ef.state_tensors()[0].abs().sum() == 0  # a failed sync keeps the old residuals
    ef.stage(0, c, torch.full((2, 2), 0.25), rows=slice(2, 4))
    assert ef.state_tensors()[0].abs().sum() == 0  # staged, not yet current
    ef.commit()
    e = ef.state_tensors()[0]
    assert torch.equal(e[2:4], torch.full((2, 2), 0.75)) and e[:2].abs().sum() == 0 and e[4:].abs().sum() == 0
    torch.testing.assert_close(ef.compensate(0, torch.ones(6, 2))[2:4], torch.full((2, 2), 1.75))
    with pytest.raises(ValueError, match="expected"):
        ef.compensate(1, torch.ones(4))


def test_residuals_are_the_committed_ones_and_load_back():
    ef = ErrorFeedback([(6, 2), (3,)])
    assert ef.residuals() is None  # nothing committed: nothing for a checkpoint
    c = ef.compensate(0, torch.ones(2, 2), rows=slice(0, 2))
    ef.stage(0, c, torch.full((2, 2), 0.25), rows=slice(0, 2))
    ef.commit()
    ef.stage(0, torch.ones(6, 2), torch.zeros(6, 2))  # a sync still running: not in the residuals
    saved = ef.residuals()
    assert torch.equal(saved[0][:2], torch.full((2, 2), 0.75)) and saved[0][2:].abs().sum() == 0
    assert torch.equal(saved[1], torch.zeros(3))  # never committed: zeros
    saved[0].fill_(5.0)
    assert ef.residuals()[0][0, 0] == 0.75  # copies, not the live buffers

    restored = ErrorFeedback([(6, 2), (3,)])
    restored.load_residuals(ef.residuals())
    for a, b in zip(restored.residuals(), ef.residuals()):
        assert torch.equal(a, b)
    x = torch.randn(6, 2)
    assert torch.equal(restored.compensate(0, x), ef.compensate(0, x))  # the next sync adds the same


def test_load_residuals_refuses_what_does_not_fit_and_keeps_the_old_ones():
    ef = ErrorFeedback([(2, 2)])
    ef.load_residuals([torch.ones(2, 2)])
    with pytest.raises(ValueError, match="expected 1"):
        ef.load_residuals([torch.ones(2, 2), torch.ones(2)])
    with pytest.raises(ValueError, match=r"residual 0: shape \(4,\)"):
        ef.load_residuals([torch.ones(4)])
    with pytest.raises(ValueError, match="non-finite"):
        ef.load_residuals([torch.full((2, 2), float("nan"))])
    assert torch.equal(ef.residuals()[0], torch.ones(2, 2))


def _piece(tensor: int, start: int, stop: int) -> Piece:
    return Piece(index=0, tensor=tensor, start=start, stop=stop, owner=0)


def test_sync_feedback_without_a_lossy_codec_carries_only_skipped_pieces():
    shapes = [torch.Size([4, 2]), torch.Size([3])]
    ef = ErrorFeedback(shapes[:1])  # tensor 1 is φ (NoLoCo): no residual
    hooks = SyncFeedback(ef, [0, 1], shapes, phi_from=1, feeds=False)
    x = torch.ones(2, 2)
    assert hooks.compensate(_piece(0, 0, 2), x) is x  # nothing held: no copy
    hooks.stage(_piece(0, 0, 2), x, x)
    ef.commit()
    assert not ef.holds(0)  # a zero residual allocates nothing
    hooks.stage(_piece(0, 2, 4), 2 * x, None)  # skipped: carried whole
    hooks.stage(_piece(1, 0, 3), torch.ones(3), None)  # φ: never carried
    ef.commit()
    assert torch.equal(ef.residuals()[0], torch.tensor([[0.0, 0], [0, 0], [2, 2], [2, 2]]))
    sent = hooks.compensate(_piece(0, 2, 4), x)
    assert torch.equal(sent, 3 * x)
    hooks.stage(_piece(0, 2, 4), sent, sent)  # sent and applied: spent, not the codec's error
    ef.commit()
    assert not ef.residuals()[0].any()


def test_sync_feedback_with_a_lossy_codec_stages_the_codecs_error():
    ef = ErrorFeedback([torch.Size([4])])
    hooks = SyncFeedback(ef, [0], [torch.Size([4])], phi_from=None, feeds=True)
    x = torch.tensor([1.0, 2.0])
    compensated = hooks.compensate(_piece(0, 0, 2), x)
    assert compensated is not x and torch.equal(compensated, x)
    hooks.stage(_piece(0, 0, 2), compensated, torch.tensor([1.0, 1.5]))
    hooks.stage(_piece(0, 2, 4), x, None)
    ef.commit()
    assert torch.equal(ef.residuals()[0], torch.tensor([0.0, 0.5, 1.0, 2.0]))


def test_a_piece_sent_exactly_stages_no_tensor_and_commits_a_zero_residual():
    """``stage(c, c)`` (an exact codec, an owner's own rows) holds no tensor of zeros while the sync
    runs; its commit zeroes those rows of a residual already held and creates none where none is."""
    ef = ErrorFeedback([(4, 2), (3,)])
    x = torch.ones(4, 2)
    ef.stage(0, x + 0.5, x)  # rows lost 0.5 each
    ef.commit()
    assert torch.equal(ef.state_tensors()[0], torch.full((4, 2), 0.5))
    exact = torch.randn(2, 2)
    ef.stage(0, exact, exact, rows=slice(0, 2))
    ef.stage(1, torch.ones(3), torch.ones(3))  # equal values, not the same tensor: staged as a tensor
    assert ef._staged[0][2] is None and ef._staged[1][2] is not None
    ef.commit()
    assert torch.equal(ef.state_tensors()[0][:2], torch.zeros(2, 2))
    assert torch.equal(ef.state_tensors()[0][2:], torch.full((2, 2), 0.5))
    fresh = ErrorFeedback([(3,)])
    y = torch.ones(3)
    fresh.stage(0, y, y)
    fresh.commit()
    assert not fresh.holds(0) and fresh.residuals() is None


def test_a_run_names_its_residual_dtype_and_a_bad_one_is_refused():
    assert CompressionSpec().residual_dtype == "fp32"
    assert RESIDUAL_DTYPES[CompressionSpec(residual_dtype="bf16").residual_dtype] == torch.bfloat16
    with pytest.raises(
        ManifestError, match=r"compression.residual_dtype = 'fp16' is invalid: allowed one of 'fp32', 'bf16'"
    ):
        CompressionSpec(residual_dtype="fp16")
