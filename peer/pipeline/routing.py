"""Which replica of the next pipeline stage a micro-batch goes to (``pipeline.routing``, issue #19).

Each stage of the model is served by several peers (its replicas). A peer of stage k sends each
micro-batch's activations to one replica of stage k + 1, chosen by one of two rules:

- 'random' (NoLoCo, arXiv 2506.10911): a permutation of the replicas drawn from a seed every peer
  shares (run id, stage, inner step, block of micro-batches), so all peers agree on the assignment
  without talking, load is balanced, and activations mix across replicas, which keeps their
  weights close.
- 'fastest' (SWARM parallelism, arXiv 2301.11913): the replica with the least expected finish time,
  from a moving average of its seconds per micro-batch and this peer's calls in flight to it.

With either rule a replica whose call failed is skipped for a cooldown, and :meth:`Router.order`
returns the fallbacks after the first choice, so a caller retries a failed call on the next one.
Pure: imports neither hivemind nor torch.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence

from protocol.errors import NoReplica
from protocol.specs import ROUTINGS

logger = logging.getLogger(__name__)


def routing_seed(*, run_id: str, stage: int, step: int, block: int) -> int:
    """64-bit seed of the 'random' rule's permutation, the same on every peer.

    Hashed like protocol/groups.py's partition seed (SHA-256 of the fields, first 8 bytes), with a
    'pipeline' tag so it never coincides with a group seed.
    """
    text = f"{run_id}:pipeline:{stage}:{step}:{block}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class Router:
    """Orders the replicas of one pipeline stage for each micro-batch sent to it.

    Args:
        rule: ``pipeline.routing``: 'random' (NoLoCo) or 'fastest' (SWARM).
        run_id: the run's id (part of the shared seed).
        stage: index of the stage whose replicas this router picks (the receiving stage).
        clock: seconds, monotonic; injectable for tests.
        cooldown_s: seconds a replica is skipped after a failed call.
        default_seconds: 'fastest' prior, seconds per micro-batch, while no replica is measured.
        ema: weight of the newest measurement in the moving average, in (0, 1].

    Raises:
        ValueError: an unknown rule or an out-of-range number; the message names the value.
    """

    def __init__(
        self,
        rule: str,
        *,
        run_id: str,
        stage: int,
        clock: Callable[[], float] = time.monotonic,
        cooldown_s: float = 30.0,
        default_seconds: float = 1.0,
        ema: float = 0.3,
    ):
        if rule not in ROUTINGS:
            raise ValueError(f"pipeline.routing = {rule!r}: expected one of {', '.join(map(repr, ROUTINGS))}")
        if not isinstance(stage, int) or stage < 0:
            raise ValueError(f"stage = {stage!r}: must be an integer >= 0")
        if not (math.isfinite(cooldown_s) and cooldown_s >= 0):
            raise ValueError(f"cooldown_s = {cooldown_s!r}: must be a finite number of seconds >= 0")
        if not (math.isfinite(default_seconds) and default_seconds > 0):
            raise ValueError(f"default_seconds = {default_seconds!r}: must be a finite number of seconds > 0")
        if not 0 < ema <= 1:
            raise ValueError(f"ema = {ema!r}: must be in (0, 1]")
        self.rule, self.run_id, self.stage = rule, run_id, stage
        self._clock, self._cooldown_s = clock, cooldown_s
        self._default_seconds, self._ema = default_seconds, ema
        self._seconds: dict[str, float] = {}
        self._in_flight: dict[str, int] = {}
        self._cooling_until: dict[str, float] = {}

    def order(self, replicas: Sequence[str], *, step: int, micro_batch: int) -> list[str]:
        """The replicas to try for one micro-batch: first choice, then fallbacks.

        'random': the replicas (deduplicated, in any listed order) are sorted and shuffled with
        :func:`routing_seed` of block ``micro_batch // r`` (r replicas); micro-batch m takes slot
        ``m mod r`` and the fallbacks follow cyclically. Within a block each replica is first
        choice once, so over n consecutive micro-batches from 0 each gets ⌊n/r⌋ or ⌈n/r⌉.
        'fastest': ascending ``(in_flight + 1) × seconds_per_batch``; ties in the random order.
        Replicas cooling down after a failure are left out (the others keep their order).

        Args:
            replicas: peer ids serving the stage (the live ones this peer knows of).
            step: inner step, >= 0.
            micro_batch: index of the micro-batch within the step, >= 0.

        Returns:
            Live replicas, most preferred first; never empty.

        Raises:
            NoReplica: no replica listed, or all of them cooling down.
            ValueError: a negative step or micro-batch index.
        """
        for name, value in (("step", step), ("micro_batch", micro_batch)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} = {value!r}: must be an integer >= 0")
        ids = sorted(set(replicas))
        if ids:
            block, slot = divmod(micro_batch, len(ids))
            random.Random(routing_seed(run_id=self.run_id, stage=self.stage, step=step, block=block)).shuffle(ids)
            ids = ids[slot:] + ids[:slot]
        now = self._clock()
        live = [peer for peer in ids if self._cooling_until.get(peer, -math.inf) <= now]
        if not live:
            raise NoReplica(self.stage, cooling=len(ids))
        if self.rule == "fastest":
            rank = {peer: i for i, peer in enumerate(live)}
            live.sort(key=lambda peer: ((self._in_flight.get(peer, 0) + 1) * self.seconds_per_batch(peer), rank[peer]))
        return live

    def seconds_per_batch(self, peer: str) -> float:
        """Expected seconds for one micro-batch on ``peer``: its moving average, or the prior (the
        mean over measured replicas, ``default_seconds`` while none is measured)."""
        if peer in self._seconds:
            return self._seconds[peer]
        if self._seconds:
            return sum(self._seconds.values()) / len(self._seconds)
        return self._default_seconds

    def in_flight(self, peer: str) -> int:
        """Calls from this peer to ``peer`` started and not yet finished or failed."""
        return self._in_flight.get(peer, 0)

    def started(self, peer: str) -> None:
        """Record a call sent to ``peer``."""
        self._in_flight[peer] = self._in_flight.get(peer, 0) + 1

    def finished(self, peer: str, seconds: float) -> None:
        """Record a call to ``peer`` that succeeded after ``seconds`` (wall clock, >= 0).

        Updates the moving average (the first measurement replaces the prior). A success does not
        end a cooldown: it may be a call sent before the failure.

        Raises:
            ValueError: ``seconds`` negative or not finite; nothing recorded.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds = {seconds!r}: must be a finite duration >= 0")
        self._release(peer)
        old = self._seconds.get(peer)
        self._seconds[peer] = seconds if old is None else (1 - self._ema) * old + self._ema * seconds

    def failed(self, peer: str, reason: str) -> None:
        """Record a call to ``peer`` that failed (timeout, error): it is skipped for ``cooldown_s``."""
        self._release(peer)
        self._cooling_until[peer] = self._clock() + self._cooldown_s
        logger.info("stage %d replica %s failed (%s): skipped for %.1f s", self.stage, peer, reason, self._cooldown_s)

    def _release(self, peer: str) -> None:
        count = self._in_flight.get(peer, 0)
        if count > 1:
            self._in_flight[peer] = count - 1
        else:
            self._in_flight.pop(peer, None)


def stage_to_serve(live_replicas: Mapping[int, int], stages: int, *, requested: int | None = None) -> int:
    """The stage a joining peer serves: ``requested`` if given, else the one with the fewest live
    replicas (ties: the lowest index). Stages missing from ``live_replicas`` have none.

    Args:
        live_replicas: stage index -> live replicas serving it (counts >= 0).
        stages: S, the run's ``pipeline.stages`` (>= 1).
        requested: a stage the peer was told to serve (a flag), or None.

    Raises:
        ValueError: ``stages`` below 1, a stage index outside [0, S), or a negative count; the
            message names the value.
    """
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages = {stages!r}: must be an integer >= 1")
    for stage, count in live_replicas.items():
        if not isinstance(stage, int) or not 0 <= stage < stages:
            raise ValueError(f"stage {stage!r} in live_replicas: must be in [0, {stages})")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"live_replicas[{stage}] = {count!r}: must be an integer >= 0")
    if requested is not None:
        if not isinstance(requested, int) or not 0 <= requested < stages:
            raise ValueError(f"requested stage = {requested!r}: must be in [0, {stages})")
        return requested
    return min(range(stages), key=lambda stage: (live_replicas.get(stage, 0), stage))
