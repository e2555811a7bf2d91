"""peer.sync.transport: what a sync returns or raises, with the averager process scripted (no network)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from peer.sync.allreduce_stats import AllreduceStats
from peer.sync.averager import GroupOutcome
from peer.sync.deadlines import DeadlinePolicy
from peer.sync.pieces import SUSPECT_ROUNDS, Suspects
from peer.sync.suspicion_store import GROUPMATES_FILE, SUSPECTS_FILE, SuspectMemory
from peer.sync.transport import NetworkTransport, SyncRequest
from protocol.errors import AllreduceIncomplete, GroupNotFound, HelperDied, NetworkError, SyncError
from protocol.manifest import SyncSpec

SHAPES = [torch.Size([3, 2])]
_NEVER = object()
"""A step outcome that never comes."""


class _Control:
    def __init__(self, outcome):
        self.outcome = outcome

    def result(self, timeout=None):
        if self.outcome is _NEVER:  # the averager process died: nobody resolves the step
            raise TimeoutError()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self):
        pass


class ScriptedAverager:
    """Stands in for LocoAverager: each step's outcome comes from ``outcomes``, in order."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.buffers = [torch.zeros(s) for s in SHAPES]
        self.group_bits = []
        self.dead = False

    def check_alive(self):
        if self.dead:
            raise HelperDied("this peer's averager process (pid 1) died with exit code -9")

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffers

    def set_group_bits(self, bits):
        self.group_bits.append(bits)

    def configure_round(self, **kwargs):
        pass

    def start_step(self, **kwargs):
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, GroupOutcome) and outcome.incomplete is None:
            for buf in self.buffers:
                buf.fill_(0.5)  # the group mean
        return _Control(outcome)


def _transport(outcomes, memory_dir=None) -> NetworkTransport:
    transport = NetworkTransport.__new__(NetworkTransport)  # no hivemind: the averager is scripted
    transport.shapes, transport.run_id, transport.sync = SHAPES, "run0", SyncSpec()
    transport.deadlines = DeadlinePolicy(transport.sync)
    transport.averager = ScriptedAverager(outcomes)
    transport.suspects = Suspects()
    transport._suspect_memory = SuspectMemory(None if memory_dir is None else memory_dir / SUSPECTS_FILE)
    return transport


def _incomplete(sent, received):
    return GroupOutcome(stats=AllreduceStats(bytes_sent=sent, bytes_received=received), incomplete="owner 1 died")


def _complete(sent, received):
    stats = AllreduceStats(
        bytes_sent=sent,
        bytes_received=received,
        excluded={2: "silent"},
        partial_pieces=1,
        seconds=1.5,
        send_seconds=0.5,
        started_at=time.time(),
    )
    return GroupOutcome(gathered={"peerA": {"round": 3, "start_digest": "ab"}, "peerB": {"round": 3}}, stats=stats)


def _average(transport):
    return transport.average(
        [torch.ones(s) for s in SHAPES], request=SyncRequest(weight=10.0, round_=3, expected_group_size=2)
    )


def test_success_returns_the_mean_and_the_counters():
    transport = _transport([_complete(100, 200)])
    result = _average(transport)
    assert [t.tolist() for t in result.mean] == [[[0.5, 0.5]] * 3]
    assert (result.group, result.group_size, result.attempts) == (["peerA", "peerB"], 2, 1)
    assert (result.bytes_sent, result.bytes_received, result.excluded, result.partial_pieces) == (100, 200, 1, 1)
    assert (result.allreduce_s, result.send_s) == (1.5, 0.5) and result.allreduce_started_at > 0
    assert result.start_digests == {"peerA": "ab", "peerB": ""}
    assert result.deadline_s == (1 + NetworkTransport.RETRIES) * transport.deadlines.current().total_s


def test_an_incomplete_round_is_retried_and_both_attempts_counted():
    transport = _transport([_incomplete(10, 20), _complete(5, 6)])
    result = _average(transport)
    assert (result.attempts, result.bytes_sent, result.bytes_received) == (2, 15, 26)
    assert transport.averager.group_bits[0] != transport.averager.group_bits[1]  # the retry meets apart


def test_failure_carries_bytes_of_every_attempt_and_the_bound():
    transport = _transport([_incomplete(10, 20), _incomplete(1, 2)])
    bound = (1 + NetworkTransport.RETRIES) * transport.deadlines.current().total_s
    with pytest.raises(AllreduceIncomplete, match="round 3: owner 1 died") as info:
        _average(transport)
    assert (info.value.bytes_sent, info.value.bytes_received, info.value.deadline_s) == (11, 22, bound)


def test_no_group_is_not_retried_and_carries_the_bound():
    transport = _transport([RuntimeError("Averaging step failed: could not find a group")])
    with pytest.raises(GroupNotFound, match="no group formed for round 3") as info:
        _average(transport)
    assert isinstance(info.value, SyncError)
    assert (info.value.bytes_sent, info.value.bytes_received) == (0, 0) and info.value.deadline_s > 0
    assert transport.averager.outcomes == [] and len(transport.averager.group_bits) == 1


def test_an_averager_that_dies_during_a_step_stops_the_sync_as_averager_died_not_a_sync_error():
    transport = _transport([_NEVER])
    transport.averager.dead = True
    with pytest.raises(HelperDied, match="died") as info:
        _average(transport)
    assert not isinstance(info.value, SyncError)  # not a failed round: the peer cannot sync again
    assert len(transport.averager.group_bits) == 1  # no retry


def test_an_averager_that_never_gets_ready_is_an_error_not_a_hang(monkeypatch):
    import peer.sync.transport as transport_module

    class NeverReady:
        def __init__(self, *args, **kwargs):
            self.shut = False

        def run_in_background(self, await_ready=True, timeout=None):
            assert await_ready and timeout == transport_module.AVERAGER_START_TIMEOUT_S  # bounded
            raise TimeoutError()

        def shutdown(self):
            NeverReady.shut = True

    monkeypatch.setattr(transport_module, "LocoAverager", NeverReady)
    with pytest.raises(NetworkError, match="did not get ready within 120 s"):
        NetworkTransport(object(), SHAPES, SHAPES, "run", SyncSpec())
    assert NeverReady.shut  # its process is not left behind


def test_the_owners_it_names_are_named_again_after_a_restart(tmp_path, monkeypatch):
    """Owners the receipts proved equivocators stay in this peer's gathered ``distrust`` list across
    a restart on the same run directory (peer/sync/suspicion_store.py), until their rounds run out;
    an owner skipped by the others' refusals alone is named until the restart only."""
    import peer.sync.transport as transport_module

    outcome = _complete(100, 200)
    outcome.stats.skipped_owners = {"QmEquivocator", "QmRefused"}
    outcome.stats.equivocators = {"QmEquivocator"}
    transport = _transport([outcome], memory_dir=tmp_path)
    _average(transport)
    assert transport.suspects.named(4) == ["QmEquivocator", "QmRefused"]

    class Started:  # the averager process of the restarted peer
        def __init__(self, *args, **kwargs):
            Started.memory = kwargs["memory"]

        def run_in_background(self, await_ready=True, timeout=None):
            pass

    monkeypatch.setattr(transport_module, "LocoAverager", Started)
    restarted = NetworkTransport(object(), SHAPES, SHAPES, "run0", SyncSpec(), memory_dir=tmp_path)
    assert restarted.suspects.named(3 + SUSPECT_ROUNDS - 1) == ["QmEquivocator"]
    assert restarted.suspects.named(3 + SUSPECT_ROUNDS) == []
    assert Started.memory.file.path == tmp_path / GROUPMATES_FILE  # the averager's own file, beside it
