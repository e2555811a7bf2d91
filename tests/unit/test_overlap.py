"""The overlap update rules (peer/train/overlap.py) against references written from the papers'
equations: DiLoCoX's one-step delay (arXiv 2506.21263) and eager updates (arXiv 2502.12996)."""

import re

import pytest
import torch

from peer.train.outer import DiLoCo, NoLoCo
from peer.train.overlap import EagerState, eager_mean, next_start, preview_step, round_progress
from protocol.errors import BadPayload, ManifestError
from protocol.manifest import RunManifest, from_dict
from protocol.specs import OVERLAP_MODES, NoLoCoSpec, OuterOptimizerSpec, SyncSpec, delta_is_round_progress

SHAPES = [torch.Size([3, 4]), torch.Size([5])]


def rand(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def nesterov() -> DiLoCo:
    return DiLoCo(SHAPES, OuterOptimizerSpec(lr=0.7, momentum=0.9, nesterov=True))


def plain(lr: float = 1.0) -> DiLoCo:
    return DiLoCo(SHAPES, OuterOptimizerSpec(lr=lr, momentum=0.0, nesterov=False))


def test_overlap_is_a_validated_manifest_field_defaulting_to_none():
    assert SyncSpec().overlap == "none"
    assert RunManifest().sync.overlap == "none"
    for mode in ("none", "delayed", "eager"):
        assert from_dict({"sync": {"overlap": mode}}).sync.overlap == mode
    with pytest.raises(ManifestError, match=r"sync\.overlap = 'sometimes'.*'none', 'delayed', 'eager'"):
        from_dict({"sync": {"overlap": "sometimes"}})
    # a swarm-wide fact: it changes the run id
    assert from_dict({"sync": {"overlap": "eager"}}).run_id != RunManifest().run_id


def test_overlap_from_round_is_validated_and_left_out_of_the_encoding_at_its_default():
    eager = from_dict({"sync": {"overlap": "eager"}})
    assert eager.sync.overlap_from_round == 0 and "overlap_from_round" not in eager.to_dict()["sync"]
    # at 0 the run id is the one from before the field existed; any other K is another run
    assert eager.replace(sync={"overlap_from_round": 0}).run_id == eager.run_id
    later = from_dict({"sync": {"overlap": "delayed", "overlap_from_round": 8}})
    assert later.sync.overlap_from_round == 8 and later.to_dict()["sync"]["overlap_from_round"] == 8
    assert later.run_id != from_dict({"sync": {"overlap": "delayed"}}).run_id
    assert from_dict(later.to_dict()) == later
    for mode in ("none", "streaming"):
        with pytest.raises(
            ManifestError,
            match=rf"sync\.overlap_from_round = 8 .*0 with sync\.overlap = '{mode}'.*"
            r"set sync\.overlap_from_round = 0",
        ):
            from_dict({"sync": {"overlap": mode, "overlap_from_round": 8}})
    for bad in (-1, 2.5, True):
        with pytest.raises(ManifestError, match=rf"sync\.overlap_from_round = {re.escape(repr(bad))} is invalid"):
            from_dict({"sync": {"overlap": "eager", "overlap_from_round": bad}})


def test_delayed_phi_is_the_blocking_phi_one_round_late():
    """Identical peers whose rounds make the same progress g_t wherever they start: the delayed φ
    after round t+1 equals the blocking φ after round t (DiLoCoX one-step delay), momentum included."""
    progress = [rand(10 + t) for t in range(5)]
    blocking, delayed = nesterov(), nesterov()
    phi_b, phi_d = rand(0), rand(0)
    history_b = []
    for g in progress:
        blocking.apply(phi_b, g)
        history_b.append([p.clone() for p in phi_b])

    anchor, pending = [p.clone() for p in phi_d], None
    history_d = []
    for g in progress:
        theta = [a - x for a, x in zip(anchor, g)]  # the round's inner steps
        delta = round_progress(anchor, theta)
        if pending is not None:
            delayed.apply(phi_d, pending)  # last round's mean lands
        history_d.append([p.clone() for p in phi_d])
        pending = delta  # identical peers: the mean is Δ
        anchor = next_start("delayed", delayed, phi_d, delta, delta, share=1.0)
        for a, p, d in zip(anchor, phi_d, delta):  # θ ← φ_new + (θ − ψ_old)
            torch.testing.assert_close(a, p - d, rtol=0, atol=0)
    delayed.apply(phi_d, pending)  # the last sync lands when training ends
    history_d.append([p.clone() for p in phi_d])
    for t, phi in enumerate(history_b):
        for a, b in zip(history_d[t + 1], phi):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_delayed_plain_averaging_of_one_peer_is_continued_local_training():
    """lr 1, no momentum, one peer: each round starts where the last ended, nothing counted twice."""
    outer, phi = plain(), rand(0)
    anchor, pending = [p.clone() for p in phi], None
    for t in range(4):
        theta = [a - 0.1 * x for a, x in zip(anchor, rand(20 + t))]
        delta = round_progress(anchor, theta)
        if pending is not None:
            outer.apply(phi, pending)
        pending = delta
        anchor = next_start("delayed", outer, phi, delta, delta, share=1.0)
        for a, th in zip(anchor, theta):
            torch.testing.assert_close(a, th, rtol=0, atol=1e-6)


class PaperWorker:
    """Worker i of the eager paper, written from its equations: its own outer parameters x_i and
    SGD momentum m_i (torch.optim.SGD's update, dampening 0), stepped with Δ̂_i every round."""

    def __init__(self, x: list[torch.Tensor], lr: float, mu: float, nesterov: bool):
        self.x, self.m, self.lr, self.mu, self.nesterov = [t.clone() for t in x], None, lr, mu, nesterov

    def step(self, hat: list[torch.Tensor]) -> None:
        self.m = [h.clone() for h in hat] if self.m is None else [self.mu * m + h for m, h in zip(self.m, hat)]
        direction = [h + self.mu * m for h, m in zip(hat, self.m)] if self.nesterov else self.m
        self.x = [x - self.lr * d for x, d in zip(self.x, direction)]


@pytest.mark.parametrize(
    "lr,mu,nesterov", [(0.8, 0.0, False), (0.7, 0.9, True), (1.0, 0.5, False)], ids=["plain", "nesterov", "heavy-ball"]
)
def test_eager_matches_the_papers_per_worker_recursion(lr, mu, nesterov):
    """Eager (docs/algorithms.md §3): x_i(t) = OuterOpt_i(x_i(t−1), Δ̂_i(t)) with
    Δ̂_i(t) = (1/M)·Δ_i(t) + (1/M)·Σ_{j≠i} Δ_j(t−1), each worker with its own outer state. Each
    round's start equals the paper's x_i, momentum or not, while φ and its momentum stay shared."""
    M, rounds = 3, 6
    spec = OuterOptimizerSpec(lr=lr, momentum=mu, nesterov=nesterov)
    outers = [DiLoCo(SHAPES, spec) for _ in range(M)]
    phis = [rand(0) for _ in range(M)]
    states = [EagerState() for _ in range(M)]
    paper = [PaperWorker(phi, lr, mu, nesterov) for phi in phis]
    pending, last = None, None
    for t in range(rounds):
        deltas = [[0.05 * x for x in rand(100 * t + i)] for i in range(M)]  # Δ_i(t)
        mean = [sum(d[k] for d in deltas) / M for k in range(len(SHAPES))]
        if pending is not None:
            for outer, phi in zip(outers, phis):
                outer.apply(phi, pending)  # the correction
        for i in range(M):
            others = (
                [sum(last[j][k] for j in range(M) if j != i) / M for k in range(len(SHAPES))]
                if last is not None
                else [torch.zeros(s) for s in SHAPES]
            )
            paper[i].step([deltas[i][k] / M + others[k] for k in range(len(SHAPES))])
            start = next_start("eager", outers[i], phis[i], deltas[i], deltas[i], share=1 / M, eager=states[i])
            for a, b in zip(start, paper[i].x):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        pending, last = mean, deltas
        for phi, outer in zip(phis[1:], outers[1:]):  # φ only ever takes group means: bit-identical
            for a, b in zip([*phi, *outer.momentum], [*phis[0], *outers[0].momentum]):
                assert torch.equal(a, b)
    if mu:  # the per-worker state matters: the closed form (one step of φ with Δ/M) is not the paper's
        closed = preview_step(outers[0], phis[0], [d / M for d in deltas[0]])
        assert max((a - b).abs().max().item() for a, b in zip(closed, paper[0].x)) > 1e-3


def test_eager_leaves_phi_and_momentum_alone_and_is_corrected_by_the_mean():
    outer, phi = nesterov(), rand(0)
    outer.apply(phi, rand(1))  # some momentum
    phi_before, m_before = [p.clone() for p in phi], [m.clone() for m in outer.momentum]
    mine, n, state = rand(2), 4, EagerState()
    with pytest.raises(ValueError, match="EagerState"):
        next_start("eager", outer, phi, mine, mine, share=1 / n)
    start = next_start("eager", outer, phi, mine, mine, share=1 / n, eager=state)
    for p, b in zip(phi, phi_before):
        assert torch.equal(p, b)
    for m, b in zip(outer.momentum, m_before):
        assert torch.equal(m, b)
    lr, mu = 0.7, 0.9
    for s, p, d in zip(start, phi, mine):  # a fresh worker: its offset's first Nesterov step on Δ/n
        g = d / n
        torch.testing.assert_close(s, p - lr * (g + mu * g), rtol=1e-6, atol=1e-6)
    # the group mean arrives: φ takes the true mean, whatever the eager guess was
    reference, group_mean = nesterov(), rand(3)
    reference.momentum = [m.clone() for m in m_before]
    expected = [p.clone() for p in phi_before]
    reference.apply(expected, group_mean)
    outer.apply(phi, group_mean)
    for a, b in zip(phi, expected):
        assert torch.equal(a, b)
    # a non-finite progress leaves the state as it was; reset() makes a fresh worker again
    offset = [o.clone() for o in state.offset]
    bad = [mine[0], torch.full_like(mine[1], float("inf"))]
    with pytest.raises(BadPayload):
        next_start("eager", outer, phi, bad, bad, share=1 / n, eager=state)
    assert all(torch.equal(a, b) for a, b in zip(state.offset, offset))
    state.reset()
    again = next_start("eager", outer, phi, mine, mine, share=1 / n, eager=state)
    for s, p, d in zip(again, phi, mine):
        torch.testing.assert_close(s, p - lr * (1 + mu) * d / n, rtol=1e-6, atol=1e-6)


def test_noloco_eager_preview_has_no_pull_until_the_partner_phi_arrives():
    outer = NoLoCo(SHAPES, NoLoCoSpec(momentum=0.5, lr=0.7, pull=0.7))
    phi, d = rand(0), rand(1)
    payload = outer.payload(phi, d)
    stand_in = eager_mean(payload, n_delta=outer.phi_from(len(phi)), share=0.5)
    assert all(torch.equal(a, b) for a, b in zip(stand_in[len(phi) :], phi))  # mean φ = own φ
    start = preview_step(outer, phi, stand_in)
    for s, p, x in zip(start, phi, d):  # δ = −β·Δ/2, φ + δ
        torch.testing.assert_close(s, p - 0.7 * x / 2, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(m, torch.zeros_like(m)) for m in outer.momentum)


def test_none_bad_mode_bad_share_and_non_finite_progress():
    outer, phi, d = plain(), rand(0), rand(1)
    start = next_start("none", outer, phi, d, d, share=1.0)
    assert all(torch.equal(a, b) and a is not b for a, b in zip(start, phi))
    with pytest.raises(ValueError, match="overlap = 'later'"):
        next_start("later", outer, phi, d, d, share=1.0)
    with pytest.raises(ValueError, match="share = 0"):
        eager_mean(d, n_delta=2, share=0)
    bad = [d[0], torch.full_like(d[1], float("nan"))]
    with pytest.raises(BadPayload):
        next_start("delayed", outer, phi, bad, bad, share=1.0)


def test_every_schedule_but_streaming_holds_the_groups_means_against_the_rounds_own_delta():
    """Issue #65 item 2: a delayed or eager sync's Δ is the round's progress alone (ψ − θ), so the
    receipts' alignments and a pair's whole-Δ check run as in a blocking sync; a streaming fragment's
    Δ carries what the last landing's merge left in θ."""
    judged = {mode: delta_is_round_progress(mode) for mode in OVERLAP_MODES}
    assert judged == {"none": True, "delayed": True, "eager": True, "streaming": False}


def test_keep_skipped_progress_changes_only_the_kept_rows_and_copies_only_their_tensors():
    from peer.train.overlap import keep_skipped_progress

    g = torch.Generator().manual_seed(0)
    anchor = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.tensor(2.0)]
    delta = [torch.randn(t.shape, generator=g) for t in anchor]
    phi_before = [torch.randn(t.shape, generator=g) for t in anchor]
    phi = [p + 0.1 for p in phi_before]  # the outer step moved φ by 0.1 everywhere
    start = [p - torch.randn(p.shape, generator=g) for p in phi]  # ψ
    psi = [t.clone() for t in start]
    out = keep_skipped_progress(start, anchor, delta, phi, phi_before, [(0, 1, 3), (2, 0, 0)])
    assert out[1] is start[1] and out[0] is not start[0] and out[2] is not start[2]  # only those copied
    theta_end = [a - d for a, d in zip(anchor, delta)]  # θ as the round ended
    torch.testing.assert_close(out[0][1:3], theta_end[0][1:3] + 0.1)  # its own progress, plus φ's move
    assert torch.equal(out[0][0], start[0][0]) and torch.equal(out[0][3], start[0][3])
    torch.testing.assert_close(out[2], theta_end[2] + 0.1)  # a 0-d tensor: all of it
    assert all(torch.equal(a, b) for a, b in zip(start, psi))  # ψ itself is untouched (the anchor)
    assert keep_skipped_progress(start, anchor, delta, phi, phi_before, []) == start
