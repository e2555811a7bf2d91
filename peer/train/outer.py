"""Outer algorithms: pure tensor code, shared by the network and any in-process transport.

An outer algorithm says what a peer contributes to its group's average (its payload) and turns
the group's mean payload into a new φ. It never communicates: a transport computes the group
mean (``peer.sync.transport`` over the network, lab/inprocess.py in one process), so the code the
benchmarks measure is the code the swarm runs.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from peer.train.resync import diloco_resync_target, noloco_resync_target
from protocol.errors import BadPayload
from protocol.groups import group_of, plan_groups
from protocol.manifest import NoLoCoSpec, OuterOptimizerSpec, RunManifest

Others = Iterable[tuple[str, int, str]]
"""(peer id, round, state digest hex) of the other live peers, as their progress records say."""
Groupmates = Mapping[str, Collection[str]]
"""peer id → the groupmates its signed progress record names (peer/state/vouching.py)."""


def pseudo_gradient(phi: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = φ − θ (gradient sign convention, DiLoCo arXiv 2311.08105 Algorithm 1 line 8).

    Args:
        phi: outer parameters at the start of the round, fp32, one tensor per parameter.
        theta: inner parameters after H inner steps, same shapes.

    Returns:
        New fp32 tensors shaped like ``phi``.
    """
    return [p.detach().float() - t.detach().float() for p, t in zip(phi, theta, strict=True)]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` (any float dtype, any device) is finite.

    A tensor's sum is not finite whenever one of its elements is not (NaN and ±inf propagate, and
    +inf + −inf is NaN), so the element-wise test runs only on a tensor whose sum is not finite:
    a sum of finite values that overflows its dtype is no error. One reduction per tensor instead
    of a boolean copy of it, which counts at an overlapped round's end, where every pass is the
    inner loop's time.
    """
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def first_non_finite(tensors: Sequence[torch.Tensor]) -> int | None:
    """The index of the first tensor in ``tensors`` holding NaN or ±inf, None when every element
    is finite (:func:`all_finite` for a list).

    One reduction per tensor and one read of the result for all of them: the sum of the tensors'
    sums (in fp32) is finite unless one of them is not, or unless finite sums overflow fp32 when
    added; only then does each tensor get its own test. A model is tens to hundreds of tensors, and
    at a round's end every per-tensor host read is the inner loop's time (on a GPU each is a wait
    for the device). Tensors on more than one device are tested one by one.
    """
    tensors = list(tensors)
    counted = [t for t in tensors if t.numel()]
    if not counted:
        return None
    if len({t.device for t in counted}) == 1:
        total = torch.stack(
            [t.sum(dtype=torch.float32) if t.is_floating_point() else t.sum().float() for t in counted]
        ).sum()
        if bool(torch.isfinite(total)):
            return None
    return next((index for index, t in enumerate(tensors) if not all_finite(t)), None)


def check_finite(tensors: Sequence[torch.Tensor], what: str) -> None:
    """Raise BadPayload if any element of ``tensors`` is NaN or ±inf (:func:`first_non_finite`),
    naming the first such tensor."""
    index = first_non_finite(tensors)
    if index is not None:
        raise BadPayload(f"{what}: tensor {index} of shape {tuple(tensors[index].shape)} holds NaN or inf")


@dataclass(frozen=True)
class GroupChoice:
    """Whom this peer syncs with in a round, as its outer algorithm decides."""

    expected_size: int
    """Peers expected in the group, this one included (1: apply its own payload, no sync)."""
    index: int | None = None
    """NoLoCo's random group index, part of the matchmaking key so only groupmates meet."""
    members: tuple[str, ...] | None = None
    """The planned members when the plan names them (NoLoCo), else None."""
    note: str = ""
    """Why there is no sync this round, for the progress line ('' when there is one)."""


class OuterAlgorithm(Protocol):
    """What the round loop needs from an outer algorithm.

    Per round: ``payload(φ, Δ)`` is what the transport averages over the group (token-weighted),
    and ``apply(φ, mean)`` turns the group's mean payload into the new φ. A peer without a group
    applies its own payload (a group of one). The algorithm also decides whom a peer syncs with
    (:meth:`choose_group`) and whose state it adopts (:meth:`resync_target`), so the round loop
    has no branch on the algorithm's name.
    """

    name: str
    replicas_differ: bool
    """Peers hold different φ by design (NoLoCo, independent): evaluate each replica, report σ."""
    momentum: list[torch.Tensor]
    """The outer state, fp32 shaped like φ (what :meth:`state_tensors` returns)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors that a joiner must copy with φ (e.g. outer momentum), fp32: the algorithm's
        ``momentum`` list (:func:`step_on_copies` replaces it on a shallow copy)."""
        ...

    def payload(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The fp32 tensors this peer contributes to the group average."""
        ...

    def apply(self, phi: Sequence[torch.Tensor], group_mean: Sequence[torch.Tensor]) -> None:
        """Update ``phi`` in place from the group's mean payload."""
        ...

    def payload_shapes(self, shapes: Sequence[torch.Size]) -> list[torch.Size]:
        """Shapes of the payload for parameters of ``shapes`` (the averager's buffers)."""
        ...

    def phi_from(self, n_params: int) -> int | None:
        """Index of the first payload tensor that is φ rather than Δ, or None."""
        ...

    def choose_group(self, me: str, *, round_: int, live: Sequence[tuple[str, int]], run_id: str) -> GroupChoice:
        """Whom this peer syncs with at ``round_``; ``live``: (peer id, round) of the live peers."""
        ...

    def resync_target(
        self,
        others: Others,
        *,
        round_: int,
        digest: str,
        completed_with: Sequence[str],
        fresh: bool,
        vouchers: Collection[str] | None,
        groupmates: Groupmates | None = None,
        defers: bool = False,
    ) -> tuple[int, str, list[str]] | None:
        """(round, digest, donors) of the swarm state to adopt, or None (peer/train/resync.py).

        Only members vouched for count: ``vouchers`` (peers this peer completed an all-reduce with
        in an earlier round; None: no history, a joiner, which counts what ``groupmates`` attest).
        """
        ...


class _DeltaPayload:
    """The payload is Δ alone (DiLoCo, independent)."""

    def payload(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(delta)

    def payload_shapes(self, shapes: Sequence[torch.Size]) -> list[torch.Size]:
        return list(shapes)

    def phi_from(self, n_params: int) -> int | None:
        return None


NON_FINITE_STEP = "the outer step would leave φ or the outer momentum non-finite (fp32 overflow); φ left unchanged"
"""BadPayload's message when an outer step computed from a finite mean would not be finite."""


def _commit(
    phi: Sequence[torch.Tensor],
    new_phi: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    new_momentum: Sequence[torch.Tensor],
) -> None:
    """Copy an outer step computed out of place into ``phi`` and ``momentum``, only if every value
    is finite: a finite mean can still overflow fp32 (φ = 3e38 minus a mean of −3e38 is inf), and
    nothing a peer sends may leave a non-finite φ behind.

    Raises:
        BadPayload: a non-finite value; ``phi`` and ``momentum`` are left unchanged.
    """
    if first_non_finite([*new_phi, *new_momentum]) is not None:
        raise BadPayload(NON_FINITE_STEP)
    for dst, src in zip([*phi, *momentum], [*new_phi, *new_momentum]):
        dst.copy_(src)


def _check_mean(phi: Sequence[torch.Tensor], group_mean: Sequence[torch.Tensor], copies: int) -> None:
    if len(group_mean) != copies * len(phi):
        raise BadPayload(f"group mean has {len(group_mean)} tensors, expected {copies * len(phi)}")
    for index, d in enumerate(group_mean):
        p = phi[index % len(phi)]
        if p.shape != d.shape:
            raise BadPayload(f"group mean tensor {index} has shape {tuple(d.shape)}, φ has {tuple(p.shape)}")
    check_finite(group_mean, "the group's mean payload")


class DiLoCo(_DeltaPayload):
    """DiLoCo's outer optimizer: SGD with Nesterov (or heavy-ball) momentum on φ.

    Implements DiLoCo (arXiv 2311.08105, Algorithm 1, line 12: ``φ ← OuterOpt(φ, Δ̄)``) with
    the update of ``torch.optim.SGD(lr, momentum=μ, nesterov=True, dampening=0)``::

        m ← μ·m + Δ̄
        φ ← φ − lr·(Δ̄ + μ·m)     (Nesterov)      or      φ ← φ − lr·m     (heavy-ball)

    Args:
        shapes: the parameter shapes; momentum buffers are fp32 zeros of these shapes.
        spec: outer lr, momentum μ and the Nesterov flag from the run manifest.
    """

    name = "diloco"
    replicas_differ = False

    def __init__(self, shapes: Sequence[torch.Size], spec: OuterOptimizerSpec):
        self.spec = spec
        self.momentum = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum

    def choose_group(self, me: str, *, round_: int, live: Sequence[tuple[str, int]], run_id: str) -> GroupChoice:
        """Every live peer, whatever its round: one that is behind adopts the swarm's state and joins
        this round; one that is not there when matchmaking ends is left out. (A peer that synced
        only with peers near its round would race ahead alone when the others fall back.)"""
        (everyone,) = plan_groups(
            [me, *(peer for peer, _ in live)], algorithm=self.name, run_id=run_id, round_=round_, group_size=2
        )
        if len(everyone) == 1:
            return GroupChoice(1, note="alone: no other live peer, applied own pseudo-gradient")
        return GroupChoice(len(everyone))

    def resync_target(
        self,
        others: Others,
        *,
        round_: int,
        digest: str,
        completed_with: Sequence[str],
        fresh: bool,
        vouchers: Collection[str] | None,
        groupmates: Groupmates | None = None,
        defers: bool = False,
    ) -> tuple[int, str, list[str]] | None:
        return diloco_resync_target(
            others,
            round_=round_,
            digest=digest,
            completed_with=completed_with,
            vouchers=vouchers,
            groupmates=groupmates,
            defers=defers,
        )

    def apply(self, phi: Sequence[torch.Tensor], mean_delta: Sequence[torch.Tensor]) -> None:
        """One outer step, in place on ``phi`` and the momentum buffers.

        Args:
            phi: fp32 outer parameters, modified in place.
            mean_delta: fp32 group-mean pseudo-gradient Δ̄, shaped like ``phi``.

        Raises:
            BadPayload: Δ̄ holds NaN or inf, or its shapes differ from φ's, or the step would
                leave φ or the momentum non-finite (a finite Δ̄ can still overflow fp32); φ and the
                momentum are left unchanged.
        """
        # Two passes over one tensor at a time, not the whole step out of place: the first only checks
        # that every value will be finite, the second computes again (the same operations, the same
        # bits) and commits. A model-sized pair of temporaries (new φ, new momentum) would double
        # what the step holds at a round's end; the second pass costs a few elementwise operations.
        _check_mean(phi, mean_delta, copies=1)
        for p, d, m in zip(phi, mean_delta, self.momentum):
            new_p, new_m = self._step_one(p, d, m)
            if not (all_finite(new_p) and all_finite(new_m)):
                raise BadPayload(NON_FINITE_STEP)
        for p, d, m in zip(phi, mean_delta, self.momentum):
            new_p, new_m = self._step_one(p, d, m)
            p.copy_(new_p)
            m.copy_(new_m)

    def preview(self, phi: Sequence[torch.Tensor], mean_delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The φ that :meth:`apply` would leave, out of place: ``phi`` and the momentum are only
        read (eager's start point, peer/train/overlap.py). The same operations as :meth:`apply`,
        so bit-identical to it, without :func:`step_on_copies`' copies of φ and the momentum.

        Returns:
            New fp32 tensors shaped like ``phi``; the caller checks them for NaN/inf.

        Raises:
            BadPayload: Δ̄ has the wrong count or shapes, or holds NaN or inf.
        """
        return self._step(phi, mean_delta)[0]

    def _step(
        self, phi: Sequence[torch.Tensor], mean_delta: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(new φ, new momentum), computed out of place from a checked Δ̄."""
        _check_mean(phi, mean_delta, copies=1)
        pairs = [self._step_one(p, d, m) for p, d, m in zip(phi, mean_delta, self.momentum)]
        return [p for p, _ in pairs], [m for _, m in pairs]

    def _step_one(self, p: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(new φ, new momentum) of one tensor, out of place: m' = μ·m + Δ̄, φ' = φ − lr·(Δ̄ + μ·m')
        (Nesterov) or φ − lr·m'."""
        lr, mu = self.spec.lr, self.spec.momentum
        with torch.no_grad():
            new_m = m.mul(mu).add_(d)
            new_p = p.sub(d.add(new_m, alpha=mu) if self.spec.nesterov else new_m, alpha=lr)
        return new_p, new_m


class NoLoCo:
    """NoLoCo's outer step: average with a small random group, heavy-ball momentum plus a pull.

    Implements NoLoCo (arXiv 2506.10911, Eqs. 1-3) in the form its reference code runs
    (docs/algorithms.md §2). The paper writes Δ as fast minus slow; locoswarm keeps one convention
    end to end, Δ = φ − θ, so the paper's ``mean_G(Δ_j)`` is ``−mean_G(Δ_j)`` here::

        δ ← α·δ − β·mean_G(Δ_j) + γ·(mean_G(φ_j) − φ)
        φ ← φ + δ                                       (then θ ← φ)

    Heavy-ball momentum (α), not Nesterov. The payload is Δ followed by φ, so one weighted
    average gives both group means. With γ = β this reduces to
    φ ← φ + α·δ_old + β·(mean_G(θ_j) − φ).

    Args:
        shapes: parameter shapes; δ buffers are fp32 zeros of these shapes.
        spec: α (``momentum``), β (``lr``), γ (``pull``) from the run manifest.
    """

    name = "noloco"
    replicas_differ = True

    def __init__(self, shapes: Sequence[torch.Size], spec: NoLoCoSpec):
        self.spec = spec
        self.momentum = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum

    def payload(self, phi: Sequence[torch.Tensor], delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [*delta, *(p.detach().float() for p in phi)]

    def payload_shapes(self, shapes: Sequence[torch.Size]) -> list[torch.Size]:
        return [*shapes, *shapes]

    def phi_from(self, n_params: int) -> int | None:
        return n_params

    def choose_group(self, me: str, *, round_: int, live: Sequence[tuple[str, int]], run_id: str) -> GroupChoice:
        """This peer's random group among the peers within one round of it (in lockstep every
        peer sees the same set at its sync, so all draw the same groups)."""
        near = [me, *(peer for peer, r in live if abs(r - round_) <= 1)]
        groups = plan_groups(near, algorithm=self.name, run_id=run_id, round_=round_, group_size=self.spec.group_size)
        index, members = group_of(me, groups)
        if len(members) == 1:
            return GroupChoice(1, note="no partner this round: applied own step")
        return GroupChoice(len(members), index=index, members=tuple(members))

    def resync_target(
        self,
        others: Others,
        *,
        round_: int,
        digest: str,
        completed_with: Sequence[str],
        fresh: bool,
        vouchers: Collection[str] | None,
        groupmates: Groupmates | None = None,
        defers: bool = False,
    ) -> tuple[int, str, list[str]] | None:
        return noloco_resync_target(
            others, round_=round_, fresh=fresh, vouchers=vouchers, groupmates=groupmates, defers=defers
        )

    def apply(self, phi: Sequence[torch.Tensor], group_mean: Sequence[torch.Tensor]) -> None:
        """One outer step in place on ``phi`` and δ.

        Args:
            phi: fp32 outer parameters of this replica, modified in place.
            group_mean: token-weighted group means of the payload: mean Δ (len(phi) tensors),
                then mean φ (len(phi) tensors).

        Raises:
            BadPayload: wrong count or shapes, or non-finite values; φ and δ left unchanged.
        """
        _check_mean(phi, group_mean, copies=2)
        n = len(phi)
        a, b, g = self.spec.momentum, self.spec.lr, self.spec.pull
        with torch.no_grad():
            new_m = [
                m.mul(a).sub_(mean_d, alpha=b).add_(mean_p - p, alpha=g)
                for p, m, mean_d, mean_p in zip(phi, self.momentum, group_mean[:n], group_mean[n:])
            ]
            _commit(phi, [p.add(m) for p, m in zip(phi, new_m)], self.momentum, new_m)


class Independent(_DeltaPayload):
    """No synchronisation: φ ← θ every round (outer lr 1, no momentum). The floor in comparisons:
    it never syncs and never takes anything from other peers."""

    name = "independent"
    replicas_differ = True

    def __init__(self, shapes: Sequence[torch.Size]):
        self.momentum: list[torch.Tensor] = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum

    def choose_group(self, me: str, *, round_: int, live: Sequence[tuple[str, int]], run_id: str) -> GroupChoice:
        return GroupChoice(1, note="independent: no sync")

    def resync_target(
        self,
        others: Others,
        *,
        round_: int,
        digest: str,
        completed_with: Sequence[str],
        fresh: bool,
        vouchers: Collection[str] | None,
        groupmates: Groupmates | None = None,
        defers: bool = False,
    ) -> tuple[int, str, list[str]] | None:
        return None

    def apply(self, phi: Sequence[torch.Tensor], group_mean: Sequence[torch.Tensor]) -> None:
        _check_mean(phi, group_mean, copies=1)
        with torch.no_grad():
            _commit(phi, [p.sub(d) for p, d in zip(phi, group_mean)], [], [])


def step_on_copies(
    outer: OuterAlgorithm, phi: Sequence[torch.Tensor], state: Sequence[torch.Tensor], mean: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What ``outer.apply(φ, mean)`` makes of φ and the outer state, computed on copies: ``phi``,
    ``state`` and ``outer``'s own state are left as they are, so this may run in another thread
    while the round loop uses ``outer`` (the outer step prepared while the next round trains,
    peer/round/overlapped.py ``OverlapSchedule._prepare_step``). The same operations as :meth:`apply`, so the result is
    bit-identical to what it would leave in place.

    Args:
        outer: the run's outer algorithm (its spec is read; its state is not).
        phi: fp32 φ on the host. state: fp32 tensors shaped like ``outer.state_tensors()``.
        mean: the group's mean payload, as for :meth:`apply`.

    Returns:
        (new φ, new outer state): new contiguous fp32 host tensors.

    Raises:
        BadPayload: as :meth:`apply` (malformed or non-finite mean, or a non-finite result).
    """
    shadow = copy.copy(outer)  # shares the spec; its state is replaced by copies below
    shadow.momentum = [t.detach().to("cpu", torch.float32, copy=True).contiguous() for t in state]
    new_phi = [t.detach().to("cpu", torch.float32, copy=True).contiguous() for t in phi]
    shadow.apply(new_phi, mean)
    return new_phi, list(shadow.state_tensors())


def step_consuming_mean(
    outer: OuterAlgorithm, phi: Sequence[torch.Tensor], state: Sequence[torch.Tensor], mean: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`step_on_copies` for a mean nobody else holds: DiLoCo's new momentum is written into
    ``mean``'s own tensors, one tensor at a time, so the step makes one model-sized set of new
    tensors (the new φ) instead of three (the copies of φ and the momentum, and the mean beside
    them). The same operations as :meth:`DiLoCo.apply`, so the result is bit-identical to
    :func:`step_on_copies`. Other algorithms (NoLoCo's mean holds φ's mean, which its step reads
    after its momentum; independent keeps no state) take :func:`step_on_copies`, and ``mean`` is
    left as it is.

    Args:
        outer: the run's outer algorithm (its spec is read; its state is not).
        phi: fp32 φ on the host. state: fp32 momentum shaped like φ (``outer.state_tensors()``).
        mean: the group's mean Δ̄, fp32 contiguous host tensors shaped like φ, owned by the caller;
            not to be read again as the mean, whatever the outcome.

    Returns:
        (new φ, new momentum): new fp32 host tensors, and ``mean``'s tensors holding the momentum.

    Raises:
        BadPayload: a malformed or non-finite mean, or a non-finite result; ``phi`` and ``state`` are
            unchanged, ``mean``'s tensors may hold part of a momentum that is not kept.
    """
    if not isinstance(outer, DiLoCo) or not all(d.is_contiguous() and d.dtype == torch.float32 for d in mean):
        return step_on_copies(outer, phi, state, mean)
    _check_mean(phi, mean, copies=1)
    new_phi = []
    for p, d, m in zip(phi, mean, state, strict=True):
        new_p, new_m = outer._step_one(p.detach().float(), d, m.detach().float())
        if not (all_finite(new_p) and all_finite(new_m)):
            raise BadPayload(NON_FINITE_STEP)
        d.copy_(new_m)  # Δ̄ of this tensor is read for the last time in _step_one
        new_phi.append(new_p.contiguous())
    return new_phi, list(mean)


def make_outer(manifest: RunManifest, shapes: Sequence[torch.Size]) -> DiLoCo | NoLoCo | Independent:
    """The outer algorithm the run's manifest names (``sync.algorithm``)."""
    if manifest.sync.algorithm == "noloco":
        return NoLoCo(shapes, manifest.noloco)
    if manifest.sync.algorithm == "independent":
        return Independent(shapes)
    return DiLoCo(shapes, manifest.outer_optimizer)
