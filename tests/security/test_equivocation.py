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
from peer.sync.receipts import MeanDigests, verdict
from peer.sync.screening import Strikes
from peer.sync.suspicion_store import GROUPMATES_FILE, GroupmateMemory
from protocol.signing import seal_means
from protocol.wire import allreduce as frames
from tests.security.group import owner_means, run_group

pytestmark = pytest.mark.timeout(60)

SHAPES = [torch.Size([64, 32]), torch.Size([1024])]
N, LIAR = 5, 4


def payloads(seed: int, noise: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[b + noise * torch.randn(s, generator=gen) for b, s in zip(base, SHAPES)] for _ in range(N)]


def equivocating(honest_streams: int):
    """``_send_means`` of an owner that sends its honest means on its first ``honest_streams`` streams
    and, on the others, each mean with one value moved by 1e-5 (the issue's attack), each stream
    sealed for what it carried (an unsealed stream's means would not be applied at all)."""

    def make(session):
        streams = []

        async def send_means(writer):
            streams.append(writer)
            forged = len(streams) > honest_streams
            sent = MeanDigests()
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
                sent.add(0, payload)
                session._write(writer, payload)
                await writer.drain()
            if await session._own_seal_frame is None:
                return
            signature = seal_means(session.signer, session.plan.group_id, sent.digest(0))
            session._write(writer, frames.encode_seal(session.signer.public_der, signature))
            await writer.drain()

        return send_means

    return make


def check_pieces(sessions, skipped_owner: int, ps):
    honest = [s for s in sessions if s.plan.my_index != skipped_owner]
    mean = owner_means(ps, honest[0].plan.pieces)
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
    check_pieces(sessions, LIAR, payloads(21))
    for s in sessions[:LIAR]:
        assert s.stats.skipped_owners == {str(LIAR)}
        assert s.stats.equivocators == {str(LIAR)}  # proven by the seal of another receiver's means
        assert not s.stats.receipt_liars


def test_without_equivocation_nothing_is_skipped():
    sessions, outcomes = asyncio.run(run_group(payloads(22), [1024] * N, piece_elements=512))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    for s in sessions:
        assert not s.stats.skipped_owners and not s.stats.equivocators and len(s._receipts) == N - 1


@pytest.mark.parametrize("liars", [{4}, {3, 4}])
def test_lying_receipts_mark_their_senders_and_skip_no_honest_owner(liars):
    """Issue #65: receivers whose RECEIPTs report false digests of every owner's means (with the
    owners' real seals, which do not match), refuse every owner and report an alignment of 0. Before,
    any second digest skipped the owner: every honest owner's pieces were applied as zeros. Now the
    liars' receipts are not read: every honest peer applies the full mean, bit-identical, names the
    liars and no equivocator."""
    ps = payloads(26)
    sessions, outcomes = asyncio.run(run_group(ps, [1024] * N, piece_elements=512, lying_receipts=liars))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    mean = owner_means(ps, sessions[0].plan.pieces)
    for s in sessions:
        if s.plan.my_index in liars:
            continue
        assert s.stats.receipt_liars == {str(i) for i in liars}
        assert not s.stats.skipped_owners and not s.stats.equivocators
        for got, want in zip(s.tensors, mean):
            assert torch.allclose(got, want, atol=1e-5)
        for got, want in zip(s.tensors, sessions[0].tensors):
            assert torch.equal(got, want)
    # the averager's rule: a liar's receipts go unread, its work still counts; nobody is left out
    averager = types.SimpleNamespace(_strikes=Strikes(), _distrust=Strikes(), _memory=GroupmateMemory(None))
    LocoAverager._strike(averager, sessions[0], 7)
    assert not averager._strikes.ignored(8) and not averager._distrust.ignored(8)


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
    check_pieces(sessions, LIAR, later[:LIAR])


def report(digests, *, refused=(), sealed=None):
    """A receipt of ``digests`` (owner → digest); ``sealed``: the owners whose seal it carries (all: None)."""
    sealed = set(digests) if sealed is None else set(sealed)
    return frames.Receipt(
        dict(digests), {}, frozenset(refused), {o: (b"seal-" + d if o in sealed else b"") for o, d in digests.items()}
    )


def seal_ok(owner, digest, signature):
    """The test's stand-in for an owner's seal: valid when it names the digest it came with."""
    return signature == b"seal-" + digest


def test_the_verdict():
    a, b = b"a" * 16, b"b" * 16
    # owner 4 sealed b for receivers 2 and 3: their reports prove it equivocated
    v = verdict(
        0,
        report({1: a, 4: a}),
        {1: report({1: a, 4: a}), 2: report({1: a, 4: b}), 3: report({1: a, 4: b})},
        sealed=seal_ok,
    )
    assert v.skipped == {4} and v.equivocators == {4} and not v.liars
    # one sealed report is a proof as good as two
    v = verdict(0, report({4: a}), {1: report({4: a}), 2: report({4: b}), 3: report({4: a})}, sealed=seal_ok)
    assert v.skipped == {4} and v.equivocators == {4} and not v.liars
    # two receivers report b without the owner's seal of it: they are the liars, the owner is untouched
    v = verdict(
        0,
        report({4: a}),
        {1: report({4: a}), 2: report({4: b}, sealed=()), 3: report({4: b}, sealed=())},
        sealed=seal_ok,
    )
    assert not v.skipped and not v.equivocators and v.liars == {2, 3}
    # a receipt misstating this peer's own means: a liar, and nothing of this peer's is skipped
    v = verdict(0, report({0: a}), {1: report({0: a}), 2: report({0: b}, sealed=())}, sealed=seal_ok)
    assert not v.skipped and v.liars == {2} and not v.equivocators
    # a liar's refusals count for nothing: owner 4, refused by the liar and one honest peer of four
    v = verdict(
        0,
        report({4: a, 1: a}),
        {
            1: report({4: a, 1: a}, refused={4}),
            2: report({4: a, 1: b}, refused={4}, sealed={4}),
            3: report({4: a, 1: a}),
        },
        sealed=seal_ok,
    )
    assert v.liars == {2} and not v.skipped


def test_a_receipt_is_bounded_and_checked():
    sig = b"s" * 256
    payload = frames.encode_receipt({0: b"x" * 16, 3: b"y" * 16}, refused={3}, signatures={0: sig})
    assert frames.parse_receipt(payload, group_size=4) == frames.Receipt(
        {0: b"x" * 16, 3: b"y" * 16}, {}, frozenset({3}), {0: sig, 3: b""}
    )
    assert len(payload) <= frames.max_receipt_bytes(4)
    for bad, group in ((payload, 3), (payload[:-1], 4), (frames.encode_receipt({1: b"z" * 16}) + b"!", 4)):
        with pytest.raises(frames.BadPayload):
            frames.parse_receipt(bad, group_size=group)


def test_a_seal_is_bounded_and_checked():
    key, sig = b"k" * 294, b"s" * 256
    assert frames.parse_seal(frames.encode_seal(key, sig)) == (key, sig)
    for bad in (frames.encode_seal(b"", sig), frames.encode_seal(key, b""), frames.encode_seal(key, b"s" * 1025)):
        with pytest.raises(frames.BadPayload):
            frames.parse_seal(bad)
    with pytest.raises(frames.BadPayload, match="aborted"):
        frames.parse_seal(frames.encode_abort("no"))


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
