"""What the monitor counts per peer (bootstrap/monitor_history.py): group sizes of the rounds it saw,
and how many rounds it did not see, so the counts are not read as a peer's whole history."""

from bootstrap.monitor_history import PeerHistory
from protocol.records import ProgressRecord

H = 10


def record(round_: int, step: int = 0, group: int = 3) -> ProgressRecord:
    return ProgressRecord(
        round=round_, inner_step=round_ * H + step, train_loss=1.0, tokens_per_s=1.0, group_size=group, bytes_sent=0
    )


def test_rounds_missed_between_polls_are_counted_as_unseen():
    first = record(4, step=5)
    peer = PeerHistory(peer_id="Qm", first_seen=0.0, last_seen=0.0, last_change=0.0, record=first)
    for t, r in enumerate([first, record(5), record(5, step=2), record(9), record(12, step=3, group=2)]):
        peer.update(r, float(t), 100, H)
    out = peer.to_json(with_samples=False)
    # Rounds 5..12 happened since the first record (round 4): 5, 9 and 12 were seen (12 mid-round,
    # with its sync's group of 2); 6, 7, 8, 10 and 11 were not.
    assert out["rounds_by_group_size"] == {"2": 1, "3": 3}  # round 4's own record counts, mid-round, group 3
    assert out["group_by_round"] == {"4": 3, "5": 3, "9": 3, "12": 2}
    assert (out["first_round"], out["rounds_unseen"]) == (4, 5)


def test_a_peer_seen_every_round_has_none_unseen():
    peer = PeerHistory(peer_id="Qm", first_seen=0.0, last_seen=0.0, last_change=0.0, record=record(0))
    for t, r in enumerate(record(i) for i in range(0, 6)):
        peer.update(r, float(t), 100, H)
    out = peer.to_json(with_samples=False)
    assert out["rounds_by_group_size"] == {"3": 5} and out["rounds_unseen"] == 0
