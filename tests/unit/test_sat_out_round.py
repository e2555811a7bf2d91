"""A peer that sits out a sync for its day's budget keeps to the swarm's round
(peer/round/syncing.py ``GroupSync.keep_to_swarm``), with a scripted swarm view."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from peer.round import syncing
from peer.round.syncing import GroupSync, swarm_round
from peer.round.timing import Timing


class ScriptedSwarm:
    """Other peers' records, advanced by one inner step per read; a peer in ``stuck`` never moves."""

    peer_id = "me"
    max_sync_s = 0.0

    def __init__(self, rounds: dict[str, int], *, inner_steps: int = 4, stuck: bool = False):
        self.steps = {p: r * inner_steps for p, r in rounds.items()}
        self.H, self.stuck, self.reads = inner_steps, stuck, 0

    def others(self, max_age_s: float = 0.0):
        self.reads += 1
        if not self.stuck and self.reads > 1:
            self.steps = {p: s + 1 for p, s in self.steps.items()}
        return [
            SimpleNamespace(peer_id=p, record=SimpleNamespace(round=s // self.H, inner_step=s))
            for p, s in self.steps.items()
        ]


def sync_over(swarm) -> GroupSync:
    return GroupSync(
        manifest=None,
        outer=None,
        swarm=swarm,
        transport=None,
        reporter=None,
        stop_event=threading.Event(),
        timing=Timing(),
    )


def test_swarm_round_is_the_lower_median() -> None:
    records = [SimpleNamespace(record=SimpleNamespace(round=r)) for r in (3, 9, 4, 4)]
    assert swarm_round(records) == 4
    assert swarm_round([]) is None


def test_waits_until_the_swarm_is_past_the_round(monkeypatch) -> None:
    monkeypatch.setattr(syncing, "SAT_OUT_POLL_S", 0.0)
    swarm = ScriptedSwarm({"a": 7, "b": 7, "c": 2})  # a straggler far behind does not hold it
    note = sync_over(swarm).keep_to_swarm(7, lambda: False)
    assert note.startswith("waited") and "round 7" in note
    assert swarm_round(swarm.others()) > 7 and swarm.reads > 2


def test_no_wait_alone_or_behind_the_swarm(monkeypatch) -> None:
    monkeypatch.setattr(syncing, "SAT_OUT_POLL_S", 0.0)
    assert sync_over(ScriptedSwarm({})).keep_to_swarm(3, lambda: False) == "no other peer to keep pace with"
    behind = ScriptedSwarm({"a": 5, "b": 6})
    assert sync_over(behind).keep_to_swarm(3, lambda: False) == "the swarm is at round 5 already"
    assert behind.reads == 1


def test_a_stalled_swarm_or_a_stop_ends_the_wait(monkeypatch) -> None:
    monkeypatch.setattr(syncing, "SAT_OUT_POLL_S", 0.0)
    monkeypatch.setattr(syncing, "SWARM_STALL_S", 0.2)
    stuck = ScriptedSwarm({"a": 7, "b": 7}, stuck=True)
    assert "stayed at round 7" in sync_over(stuck).keep_to_swarm(7, lambda: False)
    moving = ScriptedSwarm({"a": 7, "b": 7})
    assert "stayed at round 7" in sync_over(moving).keep_to_swarm(7, lambda: True)
    assert moving.reads == 1
