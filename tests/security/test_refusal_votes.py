"""Issue #51, item 4 (the owner half): a receiver's refusal of an owner's Δ mean is a vote in its
RECEIPT (peer/sync/receipts.py). Real :class:`GroupAllreduce` sessions over unix sockets
(tests/security/group.py): a lying owner whose flipped means every honest receiver refuses has its
pieces skipped by every peer, the honest peers bit-identical; one receiver refusing an honest
owner's means alone (a false alarm, or a malicious receiver) skips nothing, and every peer, that
receiver included, applies the same means."""

from __future__ import annotations

import asyncio

import pytest
import torch

import peer.sync.allreduce as allreduce_module
import peer.sync.pairs as pairs_module
from peer.sync.error_feedback import ErrorFeedback
from peer.sync.pieces import MAX_DISTRUST, SUSPECT_ROUNDS, Suspects, trusted_owners
from peer.sync.receipts import verdict
from peer.sync.screening import MeanRefusal, owner_mean_problem
from protocol.manifest import CompressionSpec
from tests.security.group import owner_means, run_group
from tests.security.test_equivocation import report, seal_ok

pytestmark = pytest.mark.timeout(60)

SHAPES = [torch.Size([64, 32]), torch.Size([1024])]
N, LIAR = 5, 4


def payloads(seed: int):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[b + 0.3 * torch.randn(s, generator=gen) for b, s in zip(base, SHAPES)] for _ in range(N)]


def honest_mean(ps, sessions):
    """What honest owners send: ``piece_mean`` of ``ps`` per piece of the group's plan."""
    return owner_means(ps, sessions[0].plan.pieces)


def test_the_verdict_counts_refusals_as_votes():
    a = b"a" * 16
    # owner 4 refused by receivers 0 (this peer), 1 and 2 of 5 reports: skipped, nobody an equivocator
    v = verdict(
        0,
        report({4: a}, refused={4}),
        {1: report({4: a}, refused={4}), 2: report({4: a}, refused={4}), 3: report({4: a}), 4: report({4: a})},
        sealed=seal_ok,
    )
    assert v.skipped == {4} and v.refused == {4} and not v.equivocators and not v.liars
    # refused by one of five: applied by all
    v = verdict(
        0,
        report({4: a}),
        {1: report({4: a}, refused={4}), 2: report({4: a}), 3: report({4: a}), 4: report({4: a})},
        sealed=seal_ok,
    )
    assert not v.skipped and not v.equivocators
    # this peer's own means refused by one receiver: a vote, not a misstatement
    v = verdict(
        0, report({0: a}), {1: report({0: a}, refused={0}), 2: report({0: a}), 3: report({0: a})}, sealed=seal_ok
    )
    assert not v.skipped and not v.liars
    # half of the reports is no majority: two colluders of four cannot skip an honest owner
    v = verdict(
        0,
        report({0: a}),
        {1: report({0: a}, refused={0}), 2: report({0: a}, refused={0}), 3: report({0: a})},
        sealed=seal_ok,
    )
    assert not v.skipped
    # refusals and a sealed other digest: still told apart
    v = verdict(
        0,
        report({4: a}),
        {1: report({4: a}, refused={4}), 2: report({4: b"b" * 16}), 4: report({4: a})},
        sealed=seal_ok,
    )
    assert v.skipped == {4} and v.equivocators == {4} and not v.refused


def test_flipped_owner_means_are_skipped_by_every_peer():
    ps = payloads(31)
    sessions, outcomes = asyncio.run(
        run_group(ps, [1024] * N, piece_elements=512, max_weight=1024, liars={LIAR: lambda m: -m})
    )
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    mean = honest_mean(ps, sessions)
    honest = sessions[:LIAR]
    for s in honest:
        assert s.stats.skipped_owners == {str(LIAR)}
        for piece in s.plan.pieces:
            got = s.tensors[piece.tensor][piece.start : piece.stop]
            if piece.owner == LIAR:
                assert torch.equal(got, torch.zeros_like(got))  # skipped: this round moves nothing there
            else:
                assert torch.allclose(got, mean[piece.tensor][piece.start : piece.stop], atol=1e-5)
        for got, want in zip(s.tensors, honest[0].tensors):
            assert torch.equal(got, want)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_skipped_piece_is_carried_into_the_next_round(codec):
    """The liar's pieces, skipped, move nothing this round; each honest peer stages its own Δ there
    as its residual (with a lossless codec too), so its next contribution sends it again: the next
    round's mean there is the mean of both rounds' Δ, and the carry is spent."""
    spec = CompressionSpec(codec=codec)
    ps = payloads(41)
    feedback = [ErrorFeedback(SHAPES) for _ in range(N)]
    options = dict(piece_elements=512, max_weight=1024, spec=spec)
    first, outcomes = asyncio.run(run_group(ps, [1024] * N, liars={LIAR: lambda m: -m}, feedback=feedback, **options))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    skipped = [p for p in first[0].plan.pieces if p.owner == LIAR]
    assert skipped
    for i, s in enumerate(first[:LIAR]):
        assert s.stats.skipped_owners == {str(LIAR)}
        residuals = feedback[i].residuals()
        assert residuals is not None
        for piece in s.plan.pieces:
            rows = slice(piece.start, piece.stop)
            carried, own = residuals[piece.tensor][rows], ps[i][piece.tensor][rows]
            if piece.owner == LIAR:
                assert torch.equal(carried, own)  # all of it, none having been applied
            elif codec == "none":
                assert not carried.any()  # a lossless codec carries nothing else
            elif piece.owner != i:  # int8: what the codec dropped (an owner's own pieces stay exact)
                assert 0 < carried.norm() < 0.05 * own.norm()
    # the next round, the honest peers only: the liar's old pieces average both rounds' Δ
    nxt = payloads(42)[:LIAR]
    second, outcomes = asyncio.run(run_group(nxt, [1024] * LIAR, feedback=feedback[:LIAR], **options))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    both = honest_mean([[a + b for a, b in zip(p, q)] for p, q in zip(nxt, ps)], second)
    alone = honest_mean(nxt, second)
    tol = 1e-5 if codec == "none" else 0.05
    for t in range(len(SHAPES)):
        want = alone[t].clone()
        for piece in skipped:
            if piece.tensor == t:
                want[piece.start : piece.stop] = both[t][piece.start : piece.stop]
        assert torch.allclose(second[0].tensors[t], want, atol=tol), t
        assert not torch.allclose(alone[t], want, atol=tol) or not any(p.tensor == t for p in skipped)
    if codec == "none":
        assert all(not r.any() for f in feedback[:LIAR] for r in f.residuals())  # the carry is spent


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_blocking_sync_names_a_skipped_pieces_rows_and_carries_nothing_of_them(codec):
    """A blocking sync (``carry_skipped`` False): the liar's pieces move nothing, their rows are named in
    ``stats.kept_rows`` (the landing keeps θ's progress there, peer/train/streaming.py ``land``) and
    nothing of this round's Δ there is carried: the residual a codec left there earlier stays as it
    was. With int8 the other pieces still carry what the codec dropped."""
    spec = CompressionSpec(codec=codec)
    feedback = [ErrorFeedback(SHAPES) for _ in range(N)]
    options = dict(piece_elements=512, max_weight=1024, spec=spec, carry_skipped=False)
    earlier, outcomes = asyncio.run(run_group(payloads(40), [1024] * N, feedback=feedback, **options))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert not any(s.stats.kept_rows for s in earlier)  # nothing skipped, nothing kept
    before = [f.residuals() for f in feedback]
    ps = payloads(41)
    first, outcomes = asyncio.run(run_group(ps, [1024] * N, liars={LIAR: lambda m: -m}, feedback=feedback, **options))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    liars_rows = [(p.tensor, p.start, p.stop) for p in first[0].plan.pieces if p.owner == LIAR]
    assert liars_rows
    for i, s in enumerate(first[:LIAR]):
        assert s.stats.skipped_owners == {str(LIAR)}
        assert s.stats.kept_rows == liars_rows
        residuals = feedback[i].residuals()
        assert (residuals is None) == (codec == "none")
        for piece in s.plan.pieces:
            rows = slice(piece.start, piece.stop)
            own = ps[i][piece.tensor][rows]
            if piece.owner == LIAR:
                assert not s.results[piece.index].any()  # applied as zeros
                if residuals is not None:  # the earlier residual (staged as (Δ + e) − Δ: to rounding)
                    torch.testing.assert_close(residuals[piece.tensor][rows], before[i][piece.tensor][rows])
                    assert residuals[piece.tensor][rows].any()
            elif residuals is not None and piece.owner != i:
                assert 0 < residuals[piece.tensor][rows].norm() < 0.05 * own.norm()


def test_one_receiver_refusing_alone_skips_nothing(monkeypatch):
    """Receiver 0 refuses every Δ mean (what a false alarm, or a malicious receiver, looks like):
    its votes are one of five, so every peer applies every mean, receiver 0 included."""
    refusing = set()

    def problem(mean, contribution, **kw):
        if id(contribution) in refusing:
            return MeanRefusal("refused for the test", strike=False)
        return owner_mean_problem(mean, contribution, **kw)

    monkeypatch.setattr(pairs_module, "owner_mean_problem", problem)  # receivers check through pairs.py
    original = allreduce_module.GroupAllreduce._checked_mean

    def checked(self, owner, piece, value, included):
        if self.plan.my_index == 0:
            mine = self._sent.get(piece.index)
            if mine is not None:
                self._sent[piece.index] = mine = mine.float()
                refusing.add(id(mine))
        return original(self, owner, piece, value, included)

    monkeypatch.setattr(allreduce_module.GroupAllreduce, "_checked_mean", checked)
    ps = payloads(32)
    sessions, outcomes = asyncio.run(run_group(ps, [1024] * N, piece_elements=512, max_weight=1024))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert sessions[0].stats.refused_pieces > 0  # it did refuse
    mean = honest_mean(ps, sessions)
    for s in sessions:
        assert not s.stats.skipped_owners
        for got, want, first in zip(s.tensors, mean, sessions[1].tensors):
            assert torch.allclose(got, want, atol=1e-5) and torch.equal(got, first)


def test_an_owner_half_the_group_names_owns_nothing():
    ids = ["a", "b", "c", "d"]
    assert trusted_owners(range(4), ids, [["d"], ["d"], [], []]) == [0, 1, 2]  # 2 of 4 name d
    assert trusted_owners(range(4), ids, [["d"], [], [], []]) == [0, 1, 2, 3]  # one voice is not enough
    assert trusted_owners(range(4), ids, [["a", "b", "c", "d"]] * 4) == [0, 1, 2, 3]  # someone must reduce
    junk = ["x" * 10, 5, None, {"d": 1}, ["d"] * 1000, "d"]
    assert trusted_owners(range(4), ids, [junk[4], junk[5], junk[3], junk[1]]) == [0, 1, 2, 3]
    suspects = Suspects()
    suspects.add(["d"], 10)
    assert suspects.named(10) == ["d"] and suspects.named(10 + SUSPECT_ROUNDS) == []
    suspects.add([f"p{i}" for i in range(MAX_DISTRUST + 5)], 0)
    assert len(suspects.named(0)) == MAX_DISTRUST and "p0" not in suspects.named(0)


def test_an_owner_that_missed_a_receipt_counts_it(monkeypatch):
    """Receivers 1, 2 and 3 refuse owner 4's means: 3 of 5 reports, a majority, so every peer that
    reads them all skips owner 4. Receiver 3's RECEIPT never reaches owner 0 (a slow or dying sender):
    owner 0 counts 2 of 4 and applies owner 4's means, a state its groupmates do not hold after the
    same start. It says so (``unread_receipts``): its round claims no groupmate holds its state
    (peer/round/syncing.py)."""
    original = allreduce_module.GroupAllreduce._checked_mean

    def checked(self, owner, piece, value, included):
        if self.plan.my_index in (1, 2, 3) and owner == LIAR:
            self._sent.pop(piece.index, None)
            self._refuse(owner, f"piece {piece.index}", MeanRefusal("refused for the test", strike=False), votes=True)
            return value
        return original(self, owner, piece, value, included)

    exchange = allreduce_module.GroupAllreduce._exchange_receipts

    async def receipts(self, *, send):
        if self.plan.my_index == 3 and (writer := self._receipt_writers.pop(0, None)) is not None:
            writer.close()  # owner 0 never gets receiver 3's receipt
        await exchange(self, send=send)

    monkeypatch.setattr(allreduce_module.GroupAllreduce, "_checked_mean", checked)
    monkeypatch.setattr(allreduce_module.GroupAllreduce, "_exchange_receipts", receipts)
    sessions, outcomes = asyncio.run(run_group(payloads(33), [1024] * N, piece_elements=512, max_weight=1024))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert [s.stats.unread_receipts for s in sessions] == [1, 0, 0, 0, 0]
    assert not sessions[0].stats.skipped_owners
    assert all(s.stats.skipped_owners == {str(LIAR)} for s in sessions[1:])
    assert not all(torch.equal(a, b) for a, b in zip(sessions[0].tensors, sessions[1].tensors))
    for s in sessions[2:]:
        assert all(torch.equal(a, b) for a, b in zip(s.tensors, sessions[1].tensors))
