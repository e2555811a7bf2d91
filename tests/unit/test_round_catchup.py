"""A peer that must adopt the swarm's state does not download it just before the swarm's sync
(peer/round/catchup.py: CatchUp.about_to_sync, CatchUp.wait_until_past), with a scripted swarm view."""

from __future__ import annotations

import threading
import time
import types

from peer.net.dht import PeerProgress
from peer.progress import SyncReport
from peer.round.catchup import CatchUp
from peer.round.overlapped import OverlapSchedule
from peer.round.publishing import Publisher
from peer.round.schedule import BackgroundSchedule
from peer.round.syncing import GroupSync
from protocol.records import ProgressRecord

H = 20


def record(peer: str, round_: int, step: int) -> PeerProgress:
    return PeerProgress(
        peer_id=peer,
        expiration=0.0,
        record=ProgressRecord(
            round=round_,
            inner_step=round_ * H + step,
            train_loss=1.0,
            tokens_per_s=1.0,
            group_size=3,
            bytes_sent=0,
            state_digest="ab" * 16,
        ),
    )


class ScriptedSwarm:
    """others() returns the next scripted list of records on each call (the last one repeats)."""

    def __init__(self, *reads: list[PeerProgress], max_sync_s: float = 30.0):
        self.reads, self.calls, self.max_sync_s = list(reads), 0, max_sync_s

    def others(self, max_age_s: float = 0.0) -> list[PeerProgress]:
        self.calls += 1
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


class Schedule(types.SimpleNamespace):
    """The sync schedule of a test's peer: blocking without a background sync, else overlapped from
    round ``from_round`` (the real schedules' rules)."""

    def synced_blocking(self, round_: int) -> bool:
        return True if self.background is None else OverlapSchedule.synced_blocking(self, round_)

    def holds_leaders_back(self) -> bool:
        return False if self.background is None else BackgroundSchedule.holds_leaders_back(self)


def trainer(
    swarm: ScriptedSwarm, stop: threading.Event | None = None, disagreed=(), completed_with=("me",)
) -> types.SimpleNamespace:
    """A stand-in for :class:`CatchUp`'s attributes: its state, sync history and schedule."""
    history = types.SimpleNamespace(disagreed=set(disagreed), completed_with=tuple(completed_with), last_failed=False)
    return types.SimpleNamespace(
        state=types.SimpleNamespace(H=H, waited={"sync": 0.0, "resync": 0.0}),
        swarm=swarm,
        stop_event=stop or threading.Event(),
        history=history,
        schedule=Schedule(background=None, from_round=0, history=history),
    )


def test_donors_in_the_last_quarter_are_about_to_sync():
    donors = ["a", "b", "c"]
    early = trainer(ScriptedSwarm([record("a", 7, 10), record("b", 7, 5), record("c", 7, 0)]))
    late = trainer(ScriptedSwarm([record("a", 7, 10), record("b", 7, 15), record("c", 7, 0)]))
    other_round = trainer(ScriptedSwarm([record("a", 8, 15)]))
    not_a_donor = trainer(ScriptedSwarm([record("z", 7, 19)]))
    assert not CatchUp.about_to_sync(early, 7, donors)
    assert CatchUp.about_to_sync(late, 7, donors)  # step 15 of 20: the last record before the sync
    assert not CatchUp.about_to_sync(other_round, 7, donors)
    assert not CatchUp.about_to_sync(not_a_donor, 7, donors)


def test_wait_ends_once_most_donors_published_the_next_round(monkeypatch):
    donors = ["a", "b", "c"]
    swarm = ScriptedSwarm(
        [record("a", 7, 15), record("b", 7, 15), record("c", 7, 15)],
        [record("a", 8, 0), record("b", 7, 15), record("c", 7, 15)],  # one moved on: wait on
        [record("a", 8, 0), record("b", 8, 0), record("c", 7, 15)],
    )  # two of three: done
    t = trainer(swarm)
    monkeypatch.setattr(t.stop_event, "wait", lambda seconds: None)
    CatchUp.wait_until_past(t, 7, donors)
    assert swarm.calls == 3


def test_wait_is_bounded_by_one_sync_and_by_a_stop():
    stuck = [record("a", 7, 15), record("b", 7, 15)]
    t = trainer(ScriptedSwarm(stuck, max_sync_s=0.0))
    CatchUp.wait_until_past(t, 7, ["a", "b"])  # returns at once: its bound is 0 s
    stop = threading.Event()
    stop.set()
    t = trainer(ScriptedSwarm(stuck, max_sync_s=3600.0), stop)
    CatchUp.wait_until_past(t, 7, ["a", "b"])  # returns at once: stopped
    assert t.swarm.calls == 0


def at_round(t: types.SimpleNamespace, round_: int) -> types.SimpleNamespace:
    t.state.pos = types.SimpleNamespace(round=round_, step=0)
    return t


def test_after_a_round_it_waits_for_peers_finishing_the_same_round(monkeypatch):
    # a and b were in the last quarter of round 7 and did not complete this peer's last sync from
    # its state (another group, or none); z is early in round 7 (slower): only a and b are waited
    # for, until most published 8
    swarm = ScriptedSwarm(
        [record("a", 7, 15), record("b", 7, 19), record("z", 7, 3)],
        [record("a", 7, 15), record("b", 7, 19), record("z", 7, 3)],
        [record("a", 8, 0), record("b", 7, 19), record("z", 7, 3)],
        [record("a", 8, 0), record("b", 8, 0), record("z", 7, 4)],
    )
    t = at_round(trainer(swarm), 8)
    monkeypatch.setattr(t.stop_event, "wait", lambda seconds: None)
    CatchUp.wait_for_peers_finishing(t)
    assert swarm.calls == 4


def test_groupmates_that_completed_the_last_sync_from_this_peers_state_are_not_waited_for():
    # a and b completed round 7's sync with this peer from its state: they hold its state, their
    # next record changes nothing; c, in the same last quarter, did not (it is waited for)
    finishing = [record("a", 7, 19), record("b", 7, 18)]
    swarm = ScriptedSwarm(finishing)
    CatchUp.wait_for_peers_finishing(at_round(trainer(swarm, completed_with=("a", "b", "me")), 8))
    assert swarm.calls == 1  # nobody to wait for
    swarm = ScriptedSwarm([*finishing, record("c", 7, 19)], [*finishing, record("c", 8, 0)])
    t = at_round(trainer(swarm, completed_with=("a", "b", "me")), 8)
    t.stop_event.wait = lambda seconds: None
    CatchUp.wait_for_peers_finishing(t)
    assert swarm.calls == 2  # waited until c published round 8


def test_with_overlap_peers_outside_the_last_group_are_waited_for_only_after_a_failed_sync():
    # c finishes round 7 outside this peer's last group: with overlap it is the one off the swarm's
    # φ (it follows the swarm itself), so this peer trains on, unless its own last sync failed
    def overlapping(failed, from_round=0):
        swarm = ScriptedSwarm([record("c", 7, 19)], [record("c", 8, 0)])
        t = at_round(trainer(swarm), 8)
        t.schedule.background, t.history.last_failed = types.SimpleNamespace(in_flight=False), failed
        t.schedule.from_round = from_round
        t.stop_event.wait = lambda seconds: None
        CatchUp.wait_for_peers_finishing(t)
        return swarm.calls

    assert overlapping(failed=False) == 1
    assert overlapping(failed=True) == 2
    # sync.overlap_from_round: round 7 synced blocking when K > 7 (held together: wait, as without
    # overlap), in the background from K = 7 on
    assert overlapping(failed=False, from_round=8) == 2
    assert overlapping(failed=False, from_round=7) == 1
    swarm = ScriptedSwarm([record("c", 7, 3)], [record("c", 8, 0)])  # a disagreeing groupmate: always
    t = at_round(trainer(swarm, disagreed=("c",)), 8)
    t.schedule.background, t.stop_event.wait = types.SimpleNamespace(in_flight=True), (lambda seconds: None)
    CatchUp.wait_for_peers_finishing(t)
    assert swarm.calls == 2


def test_groupmates_that_averaged_from_another_state_are_waited_for_wherever_they_are_in_the_round(monkeypatch):
    # z averaged with this peer from another state and is early in round 7 (this peer ran ahead,
    # as a diverged peer can with overlap): it is waited for until it published round 8
    swarm = ScriptedSwarm([record("z", 7, 3)], [record("z", 7, 12)], [record("z", 8, 0)])
    t = at_round(trainer(swarm, disagreed=("z",)), 8)
    monkeypatch.setattr(t.stop_event, "wait", lambda seconds: None)
    CatchUp.wait_for_peers_finishing(t)
    assert swarm.calls == 3
    alone = ScriptedSwarm([record("z", 7, 3)])
    CatchUp.wait_for_peers_finishing(at_round(trainer(alone), 8))  # not a disagreeing groupmate
    assert alone.calls == 1


def test_no_wait_without_peers_finishing_the_previous_round():
    for others in ([], [record("a", 8, 0)], [record("a", 7, 3)], [record("a", 6, 19)]):
        swarm = ScriptedSwarm(others)
        CatchUp.wait_for_peers_finishing(at_round(trainer(swarm), 8))
        assert swarm.calls == 1  # the first read found nobody to wait for


def test_the_wait_for_finishing_peers_is_bounded(monkeypatch):
    import peer.round.catchup as round_module

    monkeypatch.setattr(round_module, "FINISHING_RECORD_WAIT_S", 0.0)
    swarm = ScriptedSwarm([record("a", 7, 19)])  # never publishes round 8 (hung or gone)
    CatchUp.wait_for_peers_finishing(at_round(trainer(swarm), 8))
    assert swarm.calls == 1
    stop = threading.Event()
    stop.set()
    monkeypatch.setattr(round_module, "FINISHING_RECORD_WAIT_S", 3600.0)
    CatchUp.wait_for_peers_finishing(at_round(trainer(ScriptedSwarm([record("a", 7, 19)]), stop), 8))


def test_the_evaluating_peer_starts_at_the_swarms_step():
    class Swarm:
        def __init__(self, now):
            self.now = now

        def step_now(self, round_, *, inner_steps, batch_size_tokens):
            assert (round_, inner_steps) == (8, H)
            return self.now

    for now, before, after in ((6, 0, 6), (0, 0, 0), (3, 5, 5)):  # never moves back
        t = at_round(
            types.SimpleNamespace(
                swarm=Swarm(now),
                state=types.SimpleNamespace(
                    H=H, m=types.SimpleNamespace(inner_optimizer=types.SimpleNamespace(batch_size_tokens=1024))
                ),
            ),
            8,
        )
        t.state.pos.step = before
        Publisher.keep_pace(t)
        assert t.state.pos.step == after


def sync_with(**result) -> SyncReport:
    """``GroupSync.sync`` of peer a, round 4, against a transport whose group a, b, c (all from
    state d) returns ``SyncResult(**result)``."""
    import torch

    from peer.sync.transport import SyncResult
    from peer.train.outer import GroupChoice

    class Transport:
        def average(self, payload, **kwargs):
            return SyncResult(
                mean=[t.clone() for t in payload],
                group=["a", "b", "c"],
                group_size=3,
                bytes_sent=1,
                bytes_received=1,
                seconds=0.1,
                start_digests={"a": "d", "b": "d", "c": "d"},
                **result,
            )

    events = []
    t = types.SimpleNamespace(
        transport=Transport(),
        stop_event=threading.Event(),
        peer_id="a",
        reporter=types.SimpleNamespace(emit=lambda event, **fields: events.append((event, fields))),
        whole_delta=True,
        carry_skipped=True,
    )
    _, report = GroupSync.sync(t, [torch.ones(3)], GroupChoice(expected_size=3), "d", round_=4, weight=1.0)
    assert events == [("sync", {"round": 4, "expected_group_size": 3, "peer_id": "a"})]  # the sync announced
    return report


def test_an_owner_whose_means_were_refused_vouches_for_nothing():
    report = sync_with(refused=("c",), refused_pieces=2)
    assert report.completed == ("b",) and set(report.agreeing) == {"a", "b"}
    assert "refused the means of 2 piece(s) from c" in report.note


def test_a_peer_that_did_not_read_every_receipt_claims_no_groupmate_holds_its_state():
    """Groupmates that read a receipt this peer did not may have skipped an owner it applied
    (peer/sync/receipts.py): the same start, another state after the round. Its groupmates still
    completed the exchange with it (its vouching ledger)."""
    report = sync_with(unread_receipts=1)
    assert report.agreeing == () and report.completed == ("b", "c")
    assert "receipts of 1 groupmate(s) not read" in report.note
    assert set(sync_with().agreeing) == {"a", "b", "c"}


def joiner(swarm: ScriptedSwarm, reads: list[bool], round_: int = 0) -> types.SimpleNamespace:
    """A peer at ``round_`` whose successive state reads find a state to adopt or not (``reads``)."""
    t = at_round(trainer(swarm), round_)
    t.reads, t.said = [], []
    t.reporter = types.SimpleNamespace(emit=lambda event, **fields: t.said.append((event, fields)))

    def catch_up_once():
        found = reads.pop(0)
        t.reads.append(found)
        if found:
            t.state.pos.round = 2  # it adopted the swarm's round
        return found

    t.wait_for_peers_finishing, t.catch_up_once = (lambda: None), catch_up_once
    t.stop_event.wait = lambda seconds: time.sleep(0.01)  # a short stand-in for the 0.5 s between reads
    return t


def test_a_fresh_peer_reads_again_while_the_records_ahead_attest_nothing_yet(monkeypatch):
    ahead = [record("a", 2, 0), record("b", 1, 17)]
    t = joiner(ScriptedSwarm(ahead), [False, False, True, False])
    CatchUp.catch_up(t)
    assert t.reads == [False, False, True, False]  # two empty reads, the adoption, nothing more
    assert t.state.waited["resync"] >= 0.02  # its two waits are idle time its next round event reports
    assert [e for e, _ in t.said] == ["status"]  # said once, with what it waits for
    assert t.said[0][1]["message"].startswith("no state to adopt yet from the 2 peer(s) ahead")
    # not fresh (resumed mid-run), or nobody ahead: one read, then it trains
    for t in (
        joiner(ScriptedSwarm(ahead), [False, True], round_=1),
        joiner(ScriptedSwarm([record("a", 0, 5)]), [False, True]),
    ):
        CatchUp.catch_up(t)
        assert t.reads == [False]
    import peer.round.catchup as round_module

    monkeypatch.setattr(round_module, "JOINER_WAIT_S", 0.0)  # bounded: then it trains from its own φ
    t = joiner(ScriptedSwarm(ahead), [False, True])
    CatchUp.catch_up(t)
    assert t.reads == [False]


def test_with_overlap_a_groupmate_one_round_ahead_is_adopted_only_when_this_peer_is_off_its_phi():
    """With a sync in flight, b one round ahead is this peer's own next state (not adopted); it is
    adopted when b averaged with this peer from another state, or when this peer's last sync failed."""
    from peer.state.vouching import Vouching
    from peer.train.outer import make_outer
    from protocol.presets import tiny_run

    def peer_at_round_3(*, disagreed=(), failed=False):
        t = at_round(trainer(ScriptedSwarm([record("b", 4, 0), record("c", 4, 0)]), disagreed=disagreed), 3)
        t.state.pos.step = 0
        t.vouching, t.state.outer = Vouching(min_round_s=0.02), make_outer(tiny_run(), [])
        t.vouching.ledger.record_group(1, ["b", "c"])  # b and c completed a sync with it before
        t.schedule.background = types.SimpleNamespace(in_flight=True)
        t.history.last_failed, t.history.completed_with, t.peer_id = failed, ("a",), "a"
        t.state.digest, t.cfg = "cd" * 16, types.SimpleNamespace(serves_state=True)
        return t

    assert CatchUp.resync_target(peer_at_round_3()) is None
    assert CatchUp.resync_target(peer_at_round_3(disagreed=("b", "c")))[:2] == (4, "ab" * 16)
    assert CatchUp.resync_target(peer_at_round_3(failed=True))[:2] == (4, "ab" * 16)
