"""protocol.records: a progress record read from the DHT is validated field by field."""

import pytest

from protocol.errors import BadPayload
from protocol.records import ProgressRecord


def test_progress_record_validation():
    record = ProgressRecord(round=1, inner_step=20, train_loss=2.5, tokens_per_s=100.0, group_size=3, bytes_sent=10)
    assert ProgressRecord.from_wire(record.to_wire()) == record
    for bad in (
        {**record.to_wire(), "round": -3},
        {**record.to_wire(), "train_loss": float("nan")},
        {**record.to_wire(), "extra": 1},
        [1, 2],
        {**record.to_wire(), "version": 99},
    ):
        with pytest.raises(BadPayload):
            ProgressRecord.from_wire(bad)
    digest = "0123456789abcdef" * 2
    assert ProgressRecord.from_wire({**record.to_wire(), "state_digest": digest}).state_digest == digest
    for bad_digest in ("0123", "X" * 32, digest.upper(), 7):
        with pytest.raises(BadPayload, match="state_digest"):
            ProgressRecord.from_wire({**record.to_wire(), "state_digest": bad_digest})


@pytest.mark.parametrize(
    "field, value",
    [("round", 2**63), ("round", 2**31), ("inner_step", 2**63), ("group_size", 5000), ("bytes_sent", 2**60)],
)
def test_counts_beyond_what_is_possible_are_rejected_by_name(field, value):
    record = ProgressRecord(round=1, inner_step=20, train_loss=2.5, tokens_per_s=100.0, group_size=3, bytes_sent=10)
    with pytest.raises(BadPayload, match=field):
        ProgressRecord.from_wire({**record.to_wire(), field: value})


def test_groupmates_are_a_signed_list_of_peer_ids():
    record = ProgressRecord(
        round=1,
        inner_step=20,
        train_loss=2.5,
        tokens_per_s=100.0,
        group_size=3,
        bytes_sent=10,
        groupmates=("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "12D3KooWabc"),
    )
    wire = record.to_wire()
    assert wire["groupmates"] == list(record.groupmates)  # msgpack has no tuple: a list is what is signed
    assert ProgressRecord.from_wire(wire) == record
    for bad in ("Qm", ["x" * 129], [""], ["a/b"], ["\x1b[2J"], [7], ["p"] * 4097):
        with pytest.raises(BadPayload, match="groupmates"):
            ProgressRecord.from_wire({**wire, "groupmates": bad})
    no_field = dict(wire)
    del no_field["groupmates"]  # a version-2 record
    with pytest.raises(BadPayload):
        ProgressRecord.from_wire(no_field)
