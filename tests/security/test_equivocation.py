"""Issue #51, item 3: an owner that sends different means to different receivers is caught.

The attack of the issue: as an owner, the attacker sent each receiver a mean differing by ~1e-5 in
one value; every copy passed the receivers' checks, and the honest φ split into one-member classes.
Here real :class:`GroupAllreduce` sessions exchange over unix sockets (tests/security/group.py); the
equivocating owner is an honest session whose MEAN frames differ per stream. The receivers' RECEIPTs
(peer/sync/receipts.py) expose it: its pieces are applied as refused by every honest peer (their
tensors stay bit-identical), it is named an equivocator, and the averager's rule ignores it from the
next round, in which its means are refused unread and its contributions left out.
"""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from peer.sync.averager import LocoAverager
from peer.sync.receipts import verdict
from peer.sync.screening import Strikes
from peer.sync.suspicion_store import GROUPMATES_FILE, GroupmateMemory
from protocol.wire import allreduce as frames
from tests.security.group import run_group

pytestmark = pytest.mark.timeout(60)

SHAPES = [torch.Size([64, 32]), torch.Size([1024])]
N, LIAR = 5, 4


def payloads(seed: int, noise: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[b + noise * torch.randn(s, generator=gen) for b, s in zip(base, SHAPES)] for _ in range(N)]


def equivocating(honest_streams: int):
    """``_send_means`` of an owner that sends its honest means on its first ``honest_streams`` streams
    and, on the others, each mean with one value moved by 1e-5 (the issue's attack)."""

    def make(session):
        streams = []

        async def send_means(writer):
            streams.append(writer)
            forged = len(streams) > honest_streams
            for piece in session.my_pieces:
                payload = await session._mean_frames[piece.index]
                if payload is None:
                    return
                if forged:
                    included, _ = frames.parse_mean(payload, expected_index=piece.index, group_size=N)
                    value = session.results[piece.index].clone()
                    value.view(-1)[0] += 1e-5
                    data, _ = session._roundtrip(piece, value, session.plan.mean_codecs[piece.index])
                    payload = frames.encode_mean(piece.index, included, data)
                session._write(writer, payload)
                await writer.drain()

        return send_means

    return make


def mean_of(ps):
    return [sum(p[k] for p in ps) / len(ps) for k in range(len(SHAPES))]


def check_pieces(sessions, skipped_owner: int, mean):
    honest = [s for s in sessions if s.plan.my_index != skipped_owner]
    for s in honest:
        for piece in s.plan.pieces:
            got = s.tensors[piece.tensor][piece.start : piece.stop]
            if piece.owner == skipped_owner:
                assert torch.equal(got, torch.zeros_like(got))  # Δ: this round moves nothing there
            else:
                assert torch.allclose(got, mean[piece.tensor][piece.start : piece.stop], atol=1e-5)
        for got, want in zip(s.tensors, honest[0].tensors):
            assert torch.equal(got, want)  # the honest peers still agree bit for bit


@pytest.mark.parametrize("honest_streams", [1, 2])
def test_an_equivocating_owner_is_caught_and_its_pieces_skipped(honest_streams):
    sessions, outcomes = asyncio.run(
        run_group(payloads(21), [1024] * N, piece_elements=512, sending={LIAR: equivocating(honest_streams)})
    )
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    check_pieces(sessions, LIAR, mean_of(payloads(21)))
    for s in sessions[:LIAR]:
        assert s.stats.skipped_owners == {str(LIAR)}
        assert s.stats.equivocators == {str(LIAR)}  # two or more receivers got another mean than the rest
        assert not s.stats.receipt_liars


def test_without_equivocation_nothing_is_skipped():
    sessions, outcomes = asyncio.run(run_group(payloads(22), [1024] * N, piece_elements=512))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    for s in sessions:
        assert not s.stats.skipped_owners and not s.stats.equivocators and len(s._receipts) == N - 1


def test_the_equivocator_is_ignored_from_the_next_round():
    # round r: caught; the averager's rule (LocoAverager._strike) marks it for every later round
    sessions, _ = asyncio.run(run_group(payloads(23), [1024] * N, piece_elements=512, sending={LIAR: equivocating(1)}))
    honest = sessions[0]
    averager = types.SimpleNamespace(_strikes=Strikes(), _distrust=Strikes(), _memory=GroupmateMemory(None))
    LocoAverager._strike(averager, honest, 7)
    assert all(averager._distrust.ignored(r) == {LIAR} for r in (8, 100, 10_000))
    assert not averager._strikes.ignored(8)  # no honest groupmate is ignored
    # round r + 1: the same owner now sends honest means; its pieces are refused unread and its
    # contribution left out of the others' means
    later = payloads(24)
    sessions, outcomes = asyncio.run(
        run_group(
            later,
            [1024] * N,
            piece_elements=512,
            ignored=frozenset({LIAR}),
            distrusted=frozenset({LIAR}),
        )
    )
    assert not any(isinstance(o, BaseException) for o in outcomes[:LIAR]), outcomes
    check_pieces(sessions, LIAR, mean_of(later[:LIAR]))


def test_the_verdict():
    a, b = b"a" * 16, b"b" * 16
    # owner 4 sent b to receivers 2 and 3: two dissenters → an equivocator
    v = verdict(0, {1: a, 4: a}, {1: {1: a, 4: a}, 2: {1: a, 4: b}, 3: {1: a, 4: b}, 4: {4: a}})
    assert v.skipped == {4} and v.equivocators == {4} and not v.liars
    # one receiver says otherwise: it may be the liar; the pieces are skipped, nobody is named
    v = verdict(0, {4: a}, {1: {4: a}, 2: {4: b}, 3: {4: a}})
    assert v.skipped == {4} and not v.equivocators
    # a receipt misstating this peer's own means: a liar
    v = verdict(0, {0: a}, {1: {0: a}, 2: {0: b}})
    assert v.skipped == {0} and v.liars == {2} and not v.equivocators


def test_a_receipt_is_bounded_and_checked():
    payload = frames.encode_receipt({0: b"x" * 16, 3: b"y" * 16})
    assert frames.parse_receipt(payload, group_size=4) == frames.Receipt({0: b"x" * 16, 3: b"y" * 16}, {})
    assert len(payload) <= frames.max_receipt_bytes(4)
    for bad, group in ((payload, 3), (payload[:-1], 4), (frames.encode_receipt({1: b"z" * 16}) + b"!", 4)):
        with pytest.raises(frames.BadPayload):
            frames.parse_receipt(bad, group_size=group)


def test_the_equivocator_is_still_ignored_after_a_restart(tmp_path):
    """The averager keeps whom it ignores in the run directory (peer/sync/suspicion_store.py): a
    restarted peer's new averager, which recalls it as ``LocoAverager.__init__`` does, still ignores
    the equivocator, and the honest groupmates still are not."""
    sessions, _ = asyncio.run(run_group(payloads(25), [1024] * N, piece_elements=512, sending={LIAR: equivocating(1)}))
    path = tmp_path / GROUPMATES_FILE
    averager = types.SimpleNamespace(_strikes=Strikes(), _distrust=Strikes(), _memory=GroupmateMemory(path, key=int))
    LocoAverager._strike(averager, sessions[0], 7)
    strikes, distrust = GroupmateMemory(path, key=int).recall()  # the restarted peer's averager
    assert all(distrust.ignored(r) == {LIAR} for r in (8, 100, 10_000))
    assert not strikes.ignored(8)
