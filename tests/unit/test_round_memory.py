"""What a peer's round holds at its peak (issue #67): two real Trainers in threads over the
in-process transport (lab/inprocess.py)."""

from __future__ import annotations

from protocol.presets import tiny_run
from tests.unit.sim_fixtures import corpus, one_thread  # noqa: F401 (fixtures)
from tests.unit.test_round_overlap import Group, Records, Transport, make_trainer, run_in_threads


class Watching(Transport):
    """Records how many snapshots its peer holds when each sync starts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state, self.held = None, []

    def average(self, payload, *, request):
        self.held.append(len(self.state.snapshots))
        return super().average(payload, request=request)


def test_a_blocking_sync_runs_without_the_snapshot_of_the_round_before_the_last(corpus):
    records, group = Records(), Group(2)
    transports = [Watching(p, group) for p in ("a", "b")]
    trainers = [make_trainer(corpus, tiny_run(), p, records, tr, rounds=3) for p, tr in zip(("a", "b"), transports)]
    for t, tr in zip(trainers, transports):
        tr.state = t.state
    run_in_threads(trainers)
    for t, tr in zip(trainers, transports):
        # the previous round's state (φ and the outer state: 2 × the model) is gone when Δ and the
        # group's mean are made, the round's end peak
        assert tr.held == [1, 1, 1]
        # and joiners are served it again between syncs: the last round's state and the one before
        assert len(t.state.snapshots) == 2
    assert trainers[0].state_digest == trainers[1].state_digest
