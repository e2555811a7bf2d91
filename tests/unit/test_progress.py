"""The round's small types (peer/progress.py): position, outcome, counters."""

from peer.progress import RoundOutcome, RoundProgress, SyncReport, TrainSummary


def test_position_indexes_the_lr_schedule_and_a_discarded_step_still_counts():
    pos = RoundProgress()
    pos.start_round(3, step=2)
    assert pos.inner_step(10) == 32
    pos.record(loss=2.0, tokens=100, seconds=0.5)
    pos.record(loss=4.0, tokens=100, seconds=0.5)
    assert (pos.step, pos.tokens, pos.train_loss, pos.tokens_per_s) == (4, 200, 3.0, 200.0)
    pos.discard_step()  # θ went back to φ: Δ covers only later steps, the schedule is not rewound
    assert (pos.step, pos.tokens, pos.inner_step(10)) == (5, 0, 35)
    pos.start_round(4)
    assert (pos.round, pos.step, pos.tokens, pos.steps_done, pos.train_loss) == (4, 0, 0, 0, 0.0)


def outcome(sync: SyncReport) -> RoundOutcome:
    return RoundOutcome(
        round=7,
        train_loss=2.5,
        tokens_per_s=10.0,
        tokens=64,
        peers=3,
        start_digest="a" * 32,
        state_digest="b" * 32,
        planned_group=None,
        sync=sync,
    )


def test_summary_adds_up_rounds_and_counts_failed_syncs():
    summary = TrainSummary(peer_id="me")
    summary.record(
        outcome(
            SyncReport(
                group_size=3, group=("me", "p1", "p2"), bytes_sent=10, bytes_received=20, attempts=1, agreeing=("p1",)
            )
        )
    )
    summary.record(outcome(SyncReport(bytes_sent=5, failed=True, note="no group")))
    fields = summary.event_fields()
    assert "peer_id" not in fields
    assert (
        fields["rounds_completed"],
        fields["max_group_size"],
        fields["bytes_sent"],
        fields["bytes_received"],
        fields["failed_syncs"],
        fields["group_sizes"],
    ) == (2, 3, 15, 20, 1, [3, 1])


def test_round_event_names_this_peer_in_its_group_and_agreeing_set():
    alone = outcome(SyncReport(note="alone")).event_fields("me")
    assert alone["group"] == ["me"] and alone["agreeing"] == ["me"] and alone["attempts"] == 0
    synced = outcome(SyncReport(group_size=2, group=("me", "p1"), agreeing=("p1",), attempts=2)).event_fields("me")
    assert synced["group"] == ["me", "p1"] and synced["agreeing"] == ["me", "p1"] and synced["attempts"] == 2


def test_round_event_carries_the_rounds_compute_seconds():
    # bench/overlap_rig.py divides these by the wall time between round events (issue 18 item 4)
    fields = RoundOutcome(
        round=1,
        train_loss=2.0,
        tokens_per_s=10.0,
        tokens=64,
        peers=1,
        start_digest="a" * 32,
        state_digest="b" * 32,
        planned_group=None,
        sync=SyncReport(),
        compute_s=6.4,
    ).event_fields("me")
    assert fields["compute_s"] == 6.4
