"""Issue #51 item 4, the NoLoCo half: a pair (NoLoCo's usual group) has no majority, so each side
judges the other's contribution (peer/sync/pairs.py). A receiver takes its own share out of the
owner's mean and checks what is left as an owner checks a partner's contribution; an honest owner
leaves a partner's Δ that points away out of its piece. A refused piece of a pair is applied as
this peer's own values (a step alone for that piece). Real :class:`GroupAllreduce` sessions over
unix sockets (tests/security/group.py), the pure checks on many honest pairs, and the round engine
(lab/engine_sim.py) on the tiny preset."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from lab.adversary import Adversary
from lab.engine_sim import run_engine_simulation
from peer.sync.pairs import PairTally, partner_problem, receiver_problem, whole_partner_problem
from peer.sync.screening import reference_rms
from protocol.presets import tiny_run
from protocol.wire import allreduce as frames
from protocol.wire.pieces import plan_pieces
from tests.security.group import run_group
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(120)

# NoLoCo's payload: Δ of a matrix and of an RMSNorm gain, then φ of both (phi_from = 2)
SHAPES = [torch.Size([64, 32]), torch.Size([64])]
PHI_FROM = len(SHAPES)
TOKENS = 1024
PIECE_ELEMENTS = 512


def honest_pair(seed: int, *, cosine: float = 0.5, weights=(TOKENS, TOKENS)) -> list[list[torch.Tensor]]:
    """Two honest NoLoCo payloads: Δ sharing a direction (cosine about ``cosine``), scaled by the
    tokens each trained, and φ of one start (matrix values ~0.02, gains ~1) a few steps apart."""
    gen = torch.Generator().manual_seed(seed)
    common = [torch.randn(s, generator=gen) for s in SHAPES]
    start = [0.02 * torch.randn(SHAPES[0], generator=gen), torch.ones(SHAPES[1])]
    own_part = math.sqrt(1 / cosine - 1)  # |common + own_part·noise|: cosine between two such Δ
    out = []
    for w in weights:
        delta = [1e-3 * (w / TOKENS) * (c + own_part * torch.randn(s, generator=gen)) for c, s in zip(common, SHAPES)]
        phi = [p + 2e-3 * torch.randn(p.shape, generator=gen) for p in start]
        out.append(delta + phi)
    return out


def owners_of(pieces, tensor: int) -> set[int]:
    return {p.owner for p in pieces if p.tensor == tensor}


def test_the_plan_deals_peer_0_the_deltas_and_peer_1_the_phis():
    """What the tests below rely on (pieces are dealt in contiguous runs of equal size)."""
    pieces = plan_pieces(SHAPES * 2, owners=[0, 1], piece_elements=PIECE_ELEMENTS)
    assert [owners_of(pieces, k) for k in range(4)] == [{0}, {0}, {1}, {1}]


FORGES = {
    "flipped": lambda m: -m,
    "flipped under the clip (-2.5x)": lambda m: -2.5 * m,
    "zeros": torch.zeros_like,
    "shrunk to a tenth": lambda m: 0.1 * m,
    "inflated (1.9x)": lambda m: 1.9 * m,  # implies a partner Δ about 2.5x this peer's, its way
}


@pytest.mark.parametrize("liar", [0, 1])
@pytest.mark.parametrize("forge", list(FORGES))
def test_a_pairs_lying_owner_is_refused_and_the_receiver_steps_alone(forge, liar):
    """The liar owns the Δ pieces (0) or the φ pieces (1) and sends its partner forged means. Before
    the pair checks, a flipped or zeroed φ of the gains passed (small pieces had a norm bound only),
    a mean shrunk to a tenth passed, and a refused Δ was applied as zeros (a lost round); now the receiver
    applies its own values there."""
    payloads, me = honest_pair(3), 1 - liar
    sessions, outcomes = asyncio.run(
        run_group(
            payloads,
            [TOKENS] * 2,
            max_weight=TOKENS,
            piece_elements=PIECE_ELEMENTS,
            phi_from=PHI_FROM,
            liars={liar: FORGES[forge]},
        )
    )
    assert not isinstance(outcomes[me], BaseException), outcomes[me]
    session = sessions[me]
    assert list(session.stats.refused) == [str(liar)]
    for piece in session.plan.pieces:
        got = session.tensors[piece.tensor][piece.start : piece.stop]
        own = payloads[me][piece.tensor][piece.start : piece.stop]
        if piece.owner == liar:  # refused, and the gains' Δ (too small to judge) with them: its own values
            assert torch.equal(got, own), (piece, forge)
        elif piece.owner == me:
            mean = (own + payloads[liar][piece.tensor][piece.start : piece.stop]) / 2
            assert torch.allclose(got, mean, atol=1e-6)
    assert not session.stats.skipped_owners  # no vote: its own values at once


def test_a_pairs_honest_owner_leaves_a_flipped_partner_delta_out():
    """The partner contributes −2.5 x its Δ (under the 3x median clip of two) where the pair's Δ
    agree (cosine about 0.95, so the flipped one points nearly opposite): the honest owner of the Δ
    pieces used to average it in and step backwards; now it leaves that Δ out of the matrix pieces
    (its mean is its own Δ); the partner's honest φ is still averaged."""
    payloads = honest_pair(4, cosine=0.95)
    honest_delta = [t.clone() for t in payloads[1][:PHI_FROM]]
    payloads[1][0] = -2.5 * payloads[1][0]
    payloads[1][1] = -2.5 * payloads[1][1]
    sessions, outcomes = asyncio.run(
        run_group(payloads, [TOKENS] * 2, max_weight=TOKENS, piece_elements=PIECE_ELEMENTS, phi_from=PHI_FROM)
    )
    assert not isinstance(outcomes[0], BaseException), outcomes[0]
    me = sessions[0]
    matrix = [p for p in me.plan.pieces if p.owner == 0 and p.tensor == 0]
    assert matrix
    for piece in matrix:
        got = me.tensors[0][piece.start : piece.stop]
        assert torch.equal(got, payloads[0][0][piece.start : piece.stop])
        assert not torch.allclose(got, (payloads[0][0] + honest_delta[0])[piece.start : piece.stop] / 2)
    assert torch.allclose(me.tensors[2], (payloads[0][2] + payloads[1][2]) / 2, atol=1e-6)


@pytest.mark.parametrize("weights", [(TOKENS, TOKENS), (TOKENS // 4, TOKENS), (TOKENS, TOKENS // 4)])
def test_an_honest_pair_is_never_refused(weights):
    """Honest NoLoCo partners (Δ at cosine about 0.3, a joiner that trained a quarter of the round,
    φ a few steps apart): no piece refused, none left out, every peer holds the weighted means."""
    payloads = honest_pair(5, cosine=0.3, weights=weights)
    sessions, outcomes = asyncio.run(
        run_group(payloads, list(weights), max_weight=TOKENS, piece_elements=PIECE_ELEMENTS, phi_from=PHI_FROM)
    )
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    total = sum(weights)
    for s in sessions:
        assert not s.stats.refused and not s.stats.excluded and not s.stats.dropped and not s.stats.partial_pieces
        for k, got in enumerate(s.tensors):
            want = (weights[0] * payloads[0][k] + weights[1] * payloads[1][k]) / total
            assert torch.allclose(got, want, atol=1e-6)


def _receiver_of_a_pair(mean, mine, *, weight: float, phi: bool, reference_rms: float):
    """``receiver_problem`` of an honest pair's receiver whose contribution the owner included."""
    return receiver_problem(
        mean,
        mine,
        weight=weight,
        included=2,
        max_weight=TOKENS,
        phi=phi,
        included_self=True,
        reference_rms=reference_rms,
        pair=True,
    )


def test_the_pair_checks_pass_many_honest_pairs():
    """The checks alone, on 200 honest pairs at cosines 0.15 to 0.95 and weights a quarter to a full
    round: no owner leaves out a partner's piece, no receiver refuses an honest mean."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        cosine = 0.15 + 0.8 * float(torch.rand(1, generator=gen))
        w = (TOKENS * (1 + int(torch.randint(0, 4, (1,), generator=gen))) // 4, TOKENS)
        a, b = honest_pair(100 + trial, cosine=cosine, weights=w)
        for (mine, w_me), (theirs, w_them) in [((a, w[0]), (b, w[1])), ((b, w[1]), (a, w[0]))]:
            for k in range(len(mine)):
                phi = k >= PHI_FROM
                rms = reference_rms(mine[PHI_FROM:] if phi else mine[:PHI_FROM])
                found = partner_problem(theirs[k], mine[k], phi=phi, pair=True, scale=w_me / w_them, reference_rms=rms)
                assert found is None, (trial, cosine, w, k, found)
                mean = (w_me * mine[k] + w_them * theirs[k]) / (w_me + w_them)
                problem = _receiver_of_a_pair(mean, mine[k], weight=w_me, phi=phi, reference_rms=rms)
                assert problem is None, (trial, cosine, w, k, problem)


def test_honest_partners_apart_as_measured_between_real_peers_pass():
    """One piece's Δ of two honest peers streaming fragments of a 2-block model pointed as far apart
    as cosine -0.52, with norms 0.31 to 3.2 times each other's (the measurement behind
    PAIR_DELTA_MIN_COSINE and PAIR_DELTA_NORM_FACTOR): neither side refuses such a partner."""
    gen = torch.Generator().manual_seed(7)
    x, noise = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    noise -= (noise @ x) / (x @ x) * x  # orthogonal to x, same norm as x
    noise *= x.norm() / noise.norm()
    for cosine, ratio in [(-0.55, 1.0), (-0.3, 0.31), (0.0, 3.2), (0.2, 1 / 3.2), (-0.5, 3.0)]:
        c = ratio * (cosine * x + math.sqrt(1 - cosine**2) * noise)
        for mine, theirs in [(x, c), (c, x)]:
            rms = float(mine.pow(2).mean().sqrt())
            assert partner_problem(theirs, mine, phi=False, pair=True, reference_rms=rms) is None, (cosine, ratio)
            problem = _receiver_of_a_pair((mine + theirs) / 2, mine, weight=TOKENS, phi=False, reference_rms=rms)
            assert problem is None, (cosine, ratio, problem)


def _tally(x: torch.Tensor, c: torch.Tensor, *, w_x: float, w_c: float, pieces: int = 4) -> PairTally:
    """What a pair's receiver folds in from honest means of ``c`` (its partner's Δ, weight ``w_c``)
    and its own ``x`` (weight ``w_x``), cut into ``pieces`` pieces."""
    tally = PairTally()
    for xs, cs in zip(x.chunk(pieces), c.chunk(pieces)):
        tally.add((w_x * xs + w_c * cs) / (w_x + w_c), xs, implied=True)
    return tally


def _apart(x: torch.Tensor, cosine: float, ratio: float, seed: int = 0) -> torch.Tensor:
    """A vector at ``cosine`` to ``x`` with ``ratio`` times its norm."""
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    noise -= (noise @ x) / (x @ x) * x
    noise *= x.norm() / noise.norm()
    return ratio * (cosine * x + math.sqrt(1 - cosine**2) * noise)


@pytest.mark.parametrize(
    "cosine,ratio,w_x,w_c",
    [
        (0.56, 0.65, TOKENS, TOKENS),  # the ends measured between real blocking NoLoCo peers
        (0.93, 1.12, TOKENS, TOKENS),
        (0.3, 1.6, TOKENS, TOKENS),  # further than measured
        (0.3, 4.0, TOKENS // 4, TOKENS),  # this peer joined a quarter into the round
        (0.3, 0.25, TOKENS, TOKENS // 4),  # its partner did
        (-0.95, 1.0, 1, TOKENS),  # this peer trained nothing since its last sync: no direction
    ],
)
def test_the_whole_delta_check_passes_honest_partners(cosine, ratio, w_x, w_c):
    """A pair's receiver judges its owner's whole Δ with the partner's claimed weight: honest
    partners as far apart as measured (and further) pass, whatever their weights."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    tally = _tally(x, _apart(x, cosine, ratio), w_x=w_x, w_c=w_c)
    measured = tally.measure(w_x, w_c)
    assert measured is not None and measured[0] == pytest.approx(cosine, abs=1e-4)
    assert measured[1] == pytest.approx(ratio, rel=1e-4)
    assert tally.problem(w_x, w_c) is None


@pytest.mark.parametrize(
    "cosine,ratio,strike",
    [
        (0.0, 1.0, False),
        (-0.5, 1.0, False),
        (-0.93, 1.9, False),
        (0.9, 2.8, True),
        (0.9, 0.3, False),
        (1.0, 0.0, False),
    ],
)
def test_the_whole_delta_check_refuses_a_flipped_inflated_or_shrunk_partner(cosine, ratio, strike):
    """Whole Δ of noise (cosine 0) or pointing away (subclip-flip's owners implied -0.93 to -0.44),
    inflated along this peer's own (about 2.8x) or shrunk to nothing: refused, a strike only over
    the norm bound."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    found = _tally(x, _apart(x, cosine, ratio), w_x=TOKENS, w_c=TOKENS).problem(TOKENS, TOKENS)
    assert found is not None and found[1] == strike, found


def test_a_direct_mean_is_judged_as_the_partners_own_delta():
    """Pieces whose mean holds only the owner's Δ (it left this peer's out) count as that Δ itself."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(3))
    tally = PairTally()
    tally.add(-x, x, implied=False)
    assert tally.measure(TOKENS, TOKENS) == pytest.approx((-1.0, 1.0))
    assert tally.problem(TOKENS, TOKENS) is not None


def test_a_pairs_owner_flipping_its_whole_delta_under_every_piece_check_is_refused():
    """The Δ owner sends means implying its partner's Δ at cosine -0.5 with the receiver's on every
    piece (each piece's norm in bounds, so no piece alone is refused): the receiver refuses the whole
    Δ at the receipts and applies its own values on every piece of that owner; with
    ``whole_delta=False`` (a streaming sync) it applies the means."""
    payloads = honest_pair(6, cosine=0.9)
    x = [t.clone() for t in payloads[1][:PHI_FROM]]
    implied = [_apart(t.flatten(), -0.5, 1.0, seed=k).view(t.shape) for k, t in enumerate(x)]
    forged = {k: (x[k] + implied[k]) / 2 for k in range(PHI_FROM)}

    def forge_of(session):
        honest = session._mean_of

        def mean_of(piece, parts, included):
            _, value, clipped = honest(piece, parts, included)
            if piece.tensor < PHI_FROM:
                value = forged[piece.tensor][piece.start : piece.stop].clone()
            data, value = session._roundtrip(piece, value, session.plan.mean_codecs[piece.index])
            return frames.encode_mean(piece.index, included, data), value, clipped

        return mean_of

    for whole in (True, False):
        sessions, outcomes = asyncio.run(
            run_group(
                payloads,
                [TOKENS] * 2,
                max_weight=TOKENS,
                piece_elements=PIECE_ELEMENTS,
                phi_from=PHI_FROM,
                whole_delta=whole,
                mean_of={0: forge_of},
            )
        )
        assert not isinstance(outcomes[1], BaseException), outcomes[1]
        me = sessions[1]
        assert list(me.stats.refused) == ([str(0)] if whole else [])
        for k in range(PHI_FROM):
            want = x[k] if whole else forged[k]
            assert torch.allclose(me.tensors[k], want, atol=1e-6), (whole, k)


@pytest.mark.parametrize("cosine,ratio", [(0.56, 0.65), (0.93, 1.12), (0.3, 1.5)])
def test_an_owner_keeps_an_honest_partners_whole_delta(cosine, ratio):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    theirs = list(_apart(x, cosine, ratio).chunk(4))
    assert whole_partner_problem(theirs, list(x.chunk(4)), weight=TOKENS, partner_weight=TOKENS) is None


def test_a_pairs_honest_owner_leaves_a_noise_partner_out_of_every_delta_piece():
    """The partner sends noise of its Δ's norm as its Δ (bench/byzantine.py ``noise``: each piece
    passes the owner's per-piece checks, cosine about 0): the honest owner of the Δ pieces judges the
    whole Δ before it reduces and leaves it out of every Δ piece (its means are its own Δ); the
    partner's φ is still averaged."""
    payloads = honest_pair(7, cosine=0.9)
    gen = torch.Generator().manual_seed(8)
    for k in range(PHI_FROM):
        noise = torch.randn(payloads[1][k].shape, generator=gen)
        payloads[1][k] = noise * payloads[1][k].norm() / noise.norm()
    sessions, outcomes = asyncio.run(
        run_group(payloads, [TOKENS] * 2, max_weight=TOKENS, piece_elements=PIECE_ELEMENTS, phi_from=PHI_FROM)
    )
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    me = sessions[0]
    for k in range(PHI_FROM):
        assert torch.equal(me.tensors[k], payloads[0][k]), k
    assert torch.allclose(me.tensors[2], (payloads[0][2] + payloads[1][2]) / 2, atol=1e-6)
    assert sessions[0].stats.partial_pieces == len([p for p in sessions[0].plan.pieces if p.tensor < PHI_FROM])


def _engine(corpus, attack: str | None):
    manifest = tiny_run().replace(sync={"algorithm": "noloco"})
    adversary = None if attack is None else Adversary(attack=attack, peers=(3,))
    return run_engine_simulation(manifest, corpus, peers=4, rounds=2, adversary=adversary, matchmaking_s=20.0)


@pytest.fixture(scope="module", autouse=True)
def warm_autograd():
    """One backward pass on this thread first (torch imports its autograd helpers lazily)."""
    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()


def test_honest_noloco_pairs_on_the_engine_refuse_nothing(corpus):
    """Four honest round loops in NoLoCo pairs: no receiver refuses a mean."""
    result = _engine(corpus, None)
    assert result.screening["rounds_with_refused_means"] == 0
    assert result.non_finite_rounds == 0 and result.honest_exits == 0


@pytest.mark.parametrize("attack", ["owner-flip", "owner-zeros", "subclip-flip"])
def test_a_lying_partner_on_the_engine_leaves_the_honest_peers_training(corpus, attack):
    """One of four peers lies as an owner (and with subclip-flip as a sender too): each honest peer
    paired with it refuses its pieces and steps alone there (before: +7 % for owner-flip, one
    honest peer's loss above φ_0's after the first round), so every honest loss stays within 3 %
    of the clean run's."""
    clean = _engine(corpus, None).history[-1].loss_bpb
    result = _engine(corpus, attack)
    assert result.screening["rounds_with_refused_means"] > 0
    assert result.non_finite_rounds == 0 and result.honest_exits == 0
    for point in result.history[1:]:
        assert point.per_peer_bpb is not None and max(point.per_peer_bpb) < result.history[0].loss_bpb
    final = result.history[-1].per_peer_bpb
    assert final is not None and max(final) < 1.03 * clean, (final, clean)
