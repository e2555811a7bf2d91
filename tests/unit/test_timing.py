"""peer/round/timing.py: ``sync.overlap`` read once into a value the schedules take."""

import pytest

from peer.round.timing import Timing
from protocol.presets import tiny_run


def test_a_runs_timing_and_the_pinned_one():
    sync = tiny_run().replace(sync={"overlap": "delayed"}).sync
    assert Timing.of(sync) == Timing(overlap="delayed", extra_steps_fraction=1.0, land_at_delay=False)
    assert Timing.of(sync, pinned=True) == Timing(overlap="delayed", extra_steps_fraction=0.0, land_at_delay=True)
    assert Timing.of(tiny_run().sync).overlap == "none"


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"overlap": "later"}, "overlap = 'later'"), ({"extra_steps_fraction": 1.5}, "extra_steps_fraction = 1.5")],
)
def test_a_bad_timing_is_named(fields, named):
    with pytest.raises(ValueError, match=named):
        Timing(**fields)


@pytest.mark.parametrize(
    ("overlap", "carries"), [("none", False), ("delayed", False), ("eager", True), ("streaming", True)]
)
def test_blocking_and_delayed_syncs_keep_a_skipped_pieces_progress_in_theta_not_in_the_carry(overlap, carries):
    """A blocking or delayed landing keeps θ's own progress on a skipped piece's rows (the next Δ holds
    it); eager and streaming carry it in the error feedback."""
    assert Timing(overlap=overlap).carries_skipped is carries
