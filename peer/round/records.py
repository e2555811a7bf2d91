"""Reads of the swarm's progress records for the round loop, asked for in the background shortly
before the loop needs them, so a read at a round's end is not the inner loop's time."""

from __future__ import annotations

import time

from peer.progress import RoundProgress
from peer.sync.membership import RoundSwarm

RECORDS_REUSE_S = 1.5
"""A read of the progress records at most this old is reused instead of reading the DHT again: at
a round's end, the read asked for in the background shortly before (:data:`RECORDS_PREFETCH_S`),
and with ``sync.overlap`` in the re-sync rule after the round, the read the round's end used."""

RECORDS_PREFETCH_S = 0.5
"""The round loop asks for the progress records in the background once the inner steps left until
it needs them (the round's end; streaming: the round's first fragment sync) take at most this long
(s, at the last step's time). With inner steps longer than this nothing is asked for ahead: the
loop reads at that point, a read that is then a small part of even one step."""


class RecordReads:
    """When to ask for the records ahead of the loop, and which read a round's group choice uses."""

    def __init__(self, swarm: RoundSwarm):
        self.swarm = swarm
        self.prefetched: tuple[int, int] | None = None
        """(round, inner step it is for) of the last read asked for in the background."""
        self.prefetched_at = float("-inf")
        """When (monotonic s) that read was asked for."""

    def after_step(self, pos: RoundProgress, needed_at: int) -> None:
        """After an inner step, the round's steps so far having taken ``pos.step_s`` seconds each on
        average: ask for the progress records in the background (``RoundSwarm.prefetch``) when the
        steps left until the loop reads them at inner step ``needed_at`` take at most
        :data:`RECORDS_PREFETCH_S`.

        Once asked, and past ``needed_at`` (a round that trains on while its sync is out, whose end
        comes when that sync lands, which no step count predicts), a read is asked for again
        whenever the last one asked is :data:`RECORDS_REUSE_S` − :data:`RECORDS_PREFETCH_S` old, so
        the point that reads finds one young enough to reuse even when the steps slowed down."""
        if pos.step > needed_at or self.prefetched == (pos.round, needed_at):
            now = time.monotonic()
            if now - self.prefetched_at >= RECORDS_REUSE_S - RECORDS_PREFETCH_S and self.swarm.prefetch():
                self.prefetched, self.prefetched_at = (pos.round, needed_at), now
            return
        left = needed_at - pos.step  # 0: the read is now, nothing left to overlap it with
        if 0 < left and left * pos.step_s <= RECORDS_PREFETCH_S and self.swarm.prefetch():
            self.prefetched, self.prefetched_at = (pos.round, needed_at), time.monotonic()

    def for_round(self, round_: int) -> list:
        """The live records a round's group choice comes from: the read asked for shortly before,
        waited for if still running, when it is at most :data:`RECORDS_REUSE_S` old; else a read now."""
        prefetched = self.prefetched is not None and self.prefetched[0] == round_
        return self.swarm.live(max_age_s=RECORDS_REUSE_S if prefetched else 0.0)
