"""The round's shared state: φ, θ, the outer state, the snapshots served to joiners, the position
in the run and the lock that guards them against the thread that serves joiners.

Every part of the round engine takes this one object: the sync schedules (peer/round/blocking.py,
overlapped.py, streamed.py), catch-up and adoption (catchup.py), checkpointing (checkpointing.py)
and progress publishing (publishing.py).

θ (and AdamW, gradients) live on the placement's device; φ and the outer state stay fp32 on the
host (pinned when the device is CUDA, until the first outer step replaces them), so Δ = φ − θ is
formed in fp32 on the host and peers that complete a round together hold bit-identical φ whatever
device they trained on.

φ and the outer state are never written in place: an outer step, a landing, an adoption, a restore
or a roll-back makes new tensors and :meth:`RoundState.install` rebinds the live state to them. So
the last snapshot holds the very tensors of the live state, not a copy (one copy of φ and the outer
state fewer per peer, and no copy at a landing), and whatever holds a tensor of φ, a payload in
flight or a prepared step's base, holds a value that does not change under it. Read φ from
:attr:`RoundState.phi` when it is used, not from a tensor kept across a landing.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Sequence

import torch

from peer.progress import RoundProgress
from peer.state.snapshot import SealedTensor, StateSnapshot, make_snapshot, make_snapshot_from
from peer.train.outer import OuterAlgorithm, first_non_finite, make_outer
from peer.train.step_bound import global_norm
from protocol.manifest import RunManifest

logger = logging.getLogger(__name__)

PHI_GROWTH_LIMIT = 10.0
"""At a round's end, a φ whose L2 norm is over this multiple of the last snapshot's is taken as
exploded and rolled back (:meth:`RoundState.guard_phi`). 10: the factor within which a downloaded
φ must lie of this peer's own (peer/state/download.py ``NORM_FACTOR``); an honest round moves φ by
its outer step, a small fraction of ‖φ‖, and each step is already bounded by this peer's own Δ
(peer/train/step_bound.py ``check_step_bound``), so only a φ that went wrong past every check gets here."""


class RoundState:
    """φ, θ, the outer state, snapshots and position of one peer.

    Attributes:
        params: θ, the model's parameters (on ``device``), in ``names`` order.
        phi: φ, one fp32 host tensor per parameter (pinned on a CUDA peer).
        outer: the outer algorithm and its state (peer/train/outer.py).
        pos: the position in the run (round, inner step of the round, the round's counters).
        lock: guards φ, the outer state and the position against the thread serving joiners.
        snapshots: states at the start of this and the last round, served to joiners (newest last);
            the older one goes once the next state is being made (:meth:`release_older_snapshot`).
        sealed: streaming: by state index (φ, then the outer state), the tensors that fragments'
            landings changed since the last snapshot, sealed (checked, hashed); the round's
            end snapshots from them (:meth:`take_snapshot` with ``from_sealed``).
        waited: seconds the training thread waited since the last ``round`` event, for a sync's
            mean (``"sync"``) and in the re-sync rule's catch-up (``"resync"``).
    """

    def __init__(self, *, manifest: RunManifest, model: torch.nn.Module, device: torch.device, state_key: str):
        self.m, self.state_key, self.device, self.model = manifest, state_key, device, model
        self.H = manifest.sync.inner_steps
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.phi = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        if device.type == "cuda":
            self.phi = [f.pin_memory() for f in self.phi]
        self.outer: OuterAlgorithm = make_outer(manifest, self.shapes)
        self.pos = RoundProgress()
        self.lock = threading.Lock()
        self.snapshots: deque[StateSnapshot] = deque(maxlen=2)
        self.sealed: dict[int, SealedTensor] = {}
        self.copying: threading.Event | None = None
        """Set once a checkpoint writer's thread wrote θ and the moments to the file (peer/round/checkpointing.py)."""
        self.views: list[tuple[list[torch.Tensor], list[int]]] = []
        """Other lists that hold live state tensors, with the state index of each entry (a fragment's
        outer state, peer/train/streaming.py ``fragment_outers``): :meth:`install` rebinds them too."""
        self.waited = {"sync": 0.0, "resync": 0.0}
        self._snapshot_norm: tuple[bytes, float] | None = None
        """(digest of a snapshot, its φ's norm): :meth:`guard_phi` measures each snapshot's φ once."""

    @property
    def inner_step(self) -> int:
        """Cumulative inner steps of φ's history: indexes the inner lr schedule."""
        return self.pos.inner_step(self.H)

    @property
    def digest(self) -> str:
        """Hex digest of the last snapshot: what this peer publishes and joiners download."""
        return self.snapshots[-1].digest.hex()

    def live_tensors(self) -> list[torch.Tensor]:
        """φ then the outer state, the tensors a snapshot holds (live: they change with the round)."""
        return [*self.phi, *self.outer.state_tensors()]

    def state_shapes(self) -> list[torch.Size]:
        return [*self.shapes, *(t.shape for t in self.outer.state_tensors())]

    def install(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Make the live state at state ``indices`` (φ, then the outer state) be ``tensors``:
        rebound, not copied (see the module), in :attr:`phi`, the outer algorithm's state list and
        every registered view. Call under :attr:`lock` where another thread may read.

        Args:
            tensors: contiguous fp32 host tensors shaped as the state's, which nothing writes from
                now on (a snapshot may hold them).

        Raises:
            ValueError: an index outside the state or a tensor of another shape or dtype; nothing
                was rebound.
        """
        n, momentum, shapes = len(self.phi), self.outer.state_tensors(), self.state_shapes()
        pairs = list(zip(indices, tensors, strict=True))
        for i, t in pairs:
            if not 0 <= i < len(shapes) or t.shape != shapes[i] or t.dtype != torch.float32:
                raise ValueError(
                    f"state tensor {i}: {tuple(t.shape)} {t.dtype} does not fit a state of {len(shapes)} fp32 "
                    "tensors shaped as this peer's"
                )
        for i, t in pairs:
            if i < n:
                self.phi[i] = t
            else:
                momentum[i - n] = t
        for view, of in self.views:
            for j, i in enumerate(of):
                view[j] = self.phi[i] if i < n else momentum[i - n]

    def install_all(self, tensors: Sequence[torch.Tensor]) -> None:
        """:meth:`install` at every state index: ``tensors`` are φ then the whole outer state."""
        self.install(range(len(tensors)), tensors)

    def take_snapshot(
        self, *, from_sealed: bool = False, verified: tuple[Sequence[torch.Tensor], Sequence[bytes]] | None = None
    ) -> None:
        """Snapshot φ, outer state and position at a round boundary (peer/state/snapshot.py); the
        snapshot holds the live tensors themselves (never written in place: see the module).

        ``from_sealed`` (streaming's round end, where φ and the outer state changed since the last
        snapshot only by the landings of fragments, each sealed): the last snapshot with the sealed
        tensors in place (``make_snapshot_from``: the same snapshot as one made afresh).
        ``verified`` (an adopted download): (the tensors installed as φ and the outer state, and their
        chunks' verified hashes): not hashed again. Else the live tensors hashed (a hashing pass; a
        copy only of a tensor that is not contiguous on the host)."""
        with self.lock:
            meta = {"run_id": self.state_key, "round": self.pos.round, "inner_step": self.pos.round * self.H}
            if from_sealed:
                snapshot = make_snapshot_from(self.snapshots[-1], meta, self.sealed.values())
            elif verified is not None:
                snapshot = make_snapshot(meta, verified[0], owned=True, chunk_hashes=verified[1])
            else:
                snapshot = make_snapshot(meta, self.live_tensors(), owned=True)
            self.install_all(snapshot.tensors)  # the same tensors, unless one had to be copied
            self.sealed = {}
        self.snapshots.append(snapshot)

    def release_older_snapshot(self) -> None:
        """Before the next state is made (a landing's sealed tensors, a prepared snapshot; a blocking
        sync's round end, before its Δ): the snapshot before the last one is no longer served, so its
        φ and outer state are freed before new ones are made; a peer then holds two states at most,
        not three.
        The last snapshot, what this peer publishes, stays. Safe from the sync's thread (a deque's
        ``popleft`` is atomic; only entries before the last one are dropped)."""
        while len(self.snapshots) > 1:
            self.snapshots.popleft()

    def guard_phi(self) -> str | None:
        """At a round's end, before its snapshot: a φ or outer state that turned non-finite, or a φ
        whose norm is over :data:`PHI_GROWTH_LIMIT` × the last snapshot's (exploded), is rolled back
        to the last snapshot (immutable: the last good state, installed again), and the landings sealed since are
        dropped, so the round's snapshot, what joiners download and what a checkpoint writes never
        hold it. θ, which a landing may have set from that φ, restarts from the restored φ.

        Returns:
            The warning to report when it rolled back, else None.
        """
        if not self.snapshots:
            return None
        last, n = self.snapshots[-1], len(self.phi)
        if self._snapshot_norm is None or self._snapshot_norm[0] != last.digest:
            self._snapshot_norm = (last.digest, global_norm(last.tensors[:n]))
        with self.lock:
            now = global_norm(self.phi)
            state = first_non_finite(self.outer.state_tensors())
            limit = PHI_GROWTH_LIMIT * self._snapshot_norm[1]
            if math.isfinite(now) and state is None and (now <= limit or not limit > 0):
                return None
            self.install_all(last.tensors)
            self.sealed = {}
        self.set_theta_to_phi()
        problem = (
            "φ turned non-finite"
            if not math.isfinite(now)
            else "the outer state turned non-finite"
            if state is not None
            else f"φ exploded: its norm {now:.4g} is over {PHI_GROWTH_LIMIT:g}x the last snapshot's "
            f"{self._snapshot_norm[1]:.4g}"
        )
        problem = f"{problem}; rolled back to the last good state (round {last.meta.get('round')})"
        logger.warning(problem)
        return problem

    def held(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        """Immutable tensors equal to what this peer holds now at these state indices: the last
        snapshot's, or the sealed result of a landing since."""
        last = self.snapshots[-1].tensors
        return tuple(self.sealed[i].tensor if i in self.sealed else last[i] for i in indices)

    def set_theta(self, source: list[torch.Tensor]) -> None:
        """θ ← ``source`` (fp32 host tensors shaped like φ): to the device, asynchronous from pinned
        memory and waited for here, so the host tensors may change again once this returns. Waits
        first for a checkpoint's copy of θ still under way."""
        self.await_theta_copy()
        cuda = self.device.type == "cuda"
        with torch.no_grad():
            for p, f in zip(self.params, source):
                p.copy_(f, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(self.device)

    def set_theta_to_phi(self) -> None:
        """θ ← φ (see :meth:`set_theta`)."""
        self.set_theta(self.phi)

    def await_theta_copy(self) -> None:
        """Before θ is written other than by an inner step's update (which waits on its own): wait
        until a checkpoint under way in the writer's thread has written θ and AdamW's moments (it
        writes them first, from the tensors as held: peer/state/checkpoint.py ``write_checkpoint``)."""
        if self.copying is not None:
            self.copying.wait()
            self.copying = None

    def theta_on_host(self) -> list[torch.Tensor]:
        """θ as fp32 host tensors (θ itself on a CPU peer, copies from a GPU)."""
        return [p.detach().to("cpu", torch.float32) for p in self.params]
