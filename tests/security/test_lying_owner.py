"""Issue 17: an owner of pieces that lies about their mean, and a NoLoCo partner that pulls φ toward 0.

Only the owner of a piece sees every contribution to it, so it could send any finite mean back.
Receivers check each mean against their own contribution (peer/sync/screening.py
``owner_mean_problem``) and apply a refused Δ piece as zeros, a refused φ piece as their own φ.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import peer.sync.screening as screening_module
from tests.security.group import owner_means, run_group


@pytest.fixture(autouse=True)
def share_check_on(monkeypatch):
    """The receivers' share check is off by default (peer/sync/screening.py OWNER_SHARE_CHECK):
    these tests test it, so they turn it on."""
    monkeypatch.setattr(screening_module, "OWNER_SHARE_CHECK", True)


SHAPES = [torch.Size([64, 32]), torch.Size([1024])]
ROUND_TOKENS = 1024

pytestmark = pytest.mark.timeout(60)


def _payloads(n, seed, noise=0.3):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[b + noise * torch.randn(s, generator=gen) for b, s in zip(base, SHAPES)] for _ in range(n)]


FORGES = {
    "sign-flipped x100": lambda m: -100 * m,
    "sign-flipped": lambda m: -m,
    "zeros": torch.zeros_like,
    "noise of the mean's norm": lambda m: (
        torch.randn(m.shape, generator=torch.Generator().manual_seed(1)) * m.norm() / m.numel() ** 0.5
    ),
}


@pytest.mark.parametrize("forge", list(FORGES))
def test_a_lying_owners_mean_is_never_applied(forge):
    n, liar = 5, 4
    payloads = _payloads(n, seed=11)
    sessions, outcomes = asyncio.run(
        run_group(
            payloads, [ROUND_TOKENS] * n, max_weight=ROUND_TOKENS, piece_elements=512, liars={liar: FORGES[forge]}
        )
    )
    honest = [s for s in sessions if s.plan.my_index != liar]
    assert not any(isinstance(o, BaseException) for o in outcomes[:liar]), outcomes
    mean = owner_means(payloads, honest[0].plan.pieces)
    for s in honest:
        assert list(s.stats.refused) == [str(liar)]
        for piece in s.plan.pieces:
            got = s.tensors[piece.tensor][piece.start : piece.stop]
            if piece.owner == liar:
                assert torch.equal(got, torch.zeros_like(got))  # refused: this round moves nothing there
            else:
                assert torch.allclose(got, mean[piece.tensor][piece.start : piece.stop], atol=1e-5)
        for got, want in zip(s.tensors, honest[0].tensors):
            assert torch.equal(got, want)  # the honest peers still agree bit for bit


@pytest.mark.parametrize("me", [0, 1])
def test_a_noloco_partner_sending_phi_zero_moves_nothing(me):
    """A pair (NoLoCo): payload [Δ, φ]; the partner sends an honest Δ and φ = 0, which used to pull
    the pair's φ halfway to zero (loss 4.9-5.5 against 2.97 in the issue's attack). Peer 1 owns
    the φ pieces here: as ``me`` = 1 this peer leaves the partner's φ out of its means, as 0 it
    refuses the partner's means of φ."""
    payloads = _payloads(2, seed=12, noise=0.02)
    partner = 1 - me
    payloads[partner][1] = torch.zeros(SHAPES[1])
    sessions, outcomes = asyncio.run(
        run_group(payloads, [ROUND_TOKENS] * 2, max_weight=ROUND_TOKENS, piece_elements=512, phi_from=1)
    )
    assert not isinstance(outcomes[me], BaseException), outcomes[me]
    mine = sessions[me]
    assert all(p.owner == 1 for p in mine.plan.pieces if p.tensor == 1)
    assert torch.equal(mine.tensors[1], payloads[me][1])  # φ: nothing of the partner's zeros
    if me == 1:
        assert partner in mine.stats.dropped
    else:
        assert list(mine.stats.refused) == [str(partner)]
    mean_delta = (payloads[0][0] + payloads[1][0]) / 2
    for piece in (p for p in mine.plan.pieces if p.tensor == 0):
        rows = slice(piece.start, piece.stop)
        # Δ as usual, but from an owner this peer refused (me = 0): a pair's owner refused on one
        # piece is trusted on none (peer/sync/pairs.py), its pieces are this peer's own values
        want = payloads[me][0][rows] if piece.owner == partner and me == 0 else mean_delta[rows]
        assert torch.allclose(mine.tensors[0][rows], want, atol=1e-6)
