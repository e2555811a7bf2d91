"""Validation of what arrives from other peers: progress records and downloaded state."""

import pytest
import torch

from peer.sync.transport import validate_state
from protocol.errors import BadPayload, BadPeerAddress
from protocol.dht import parse_initial_peers
from protocol.records import ProgressRecord

SHAPES = [torch.Size([2, 2]), torch.Size([3])]
GOOD_META = {"run_id": "abc", "round": 4, "inner_step": 80, "version": 1}


def good_tensors():
    return [torch.zeros(s) for s in SHAPES] * 2


def test_valid_state_passes():
    state = validate_state(GOOD_META, good_tensors(), run_id="abc", shapes=SHAPES)
    assert state.round == 4 and state.inner_step == 80 and len(state.phi) == 2


@pytest.mark.parametrize("meta, tensors, match", [
    ({**GOOD_META, "run_id": "other"}, None, "run 'other'"),
    ({**GOOD_META, "round": -1}, None, "round"),
    ({**GOOD_META, "round": "7"}, None, "round"),
    ("not a map", None, "map"),
    (GOOD_META, [torch.zeros(2, 2)], "tensors"),
    (GOOD_META, [torch.zeros(2, 3), torch.zeros(3)] * 2, "tensor 0"),
    (GOOD_META, [torch.zeros(2, 2, dtype=torch.float64), torch.zeros(3)] * 2, "float32"),
    (GOOD_META, [torch.full((2, 2), float("nan")), torch.zeros(3)] * 2, "NaN"),
])
def test_bad_state_is_rejected_with_reason(meta, tensors, match):
    with pytest.raises(BadPayload, match=match):
        validate_state(meta, tensors if tensors is not None else good_tensors(), run_id="abc", shapes=SHAPES)


def test_progress_record_validation():
    record = ProgressRecord(round=1, inner_step=20, train_loss=2.5, tokens_per_s=100.0, group_size=3, bytes_sent=10)
    assert ProgressRecord.from_wire(record.to_wire()) == record
    for bad in ({**record.to_wire(), "round": -3}, {**record.to_wire(), "train_loss": float("nan")},
                {**record.to_wire(), "extra": 1}, [1, 2], {**record.to_wire(), "version": 99}):
        with pytest.raises(BadPayload):
            ProgressRecord.from_wire(bad)
    digest = "0123456789abcdef" * 2
    assert ProgressRecord.from_wire({**record.to_wire(), "state_digest": digest}).state_digest == digest
    for bad_digest in ("0123", "X" * 32, digest.upper(), 7):
        with pytest.raises(BadPayload, match="state_digest"):
            ProgressRecord.from_wire({**record.to_wire(), "state_digest": bad_digest})


def test_retries_of_a_round_meet_under_their_own_key():
    from protocol.keys import round_group_bits

    first, retry = round_group_bits(7), round_group_bits(7, attempt=1)
    assert retry.startswith(first) and retry != first
    # a retry key never equals the key of a random group (NoLoCo) of the same round
    assert all(round_group_bits(7, group_index=g) != retry for g in range(16))
    assert round_group_bits(7, group_index=3, attempt=1) != round_group_bits(7, group_index=3)


def test_initial_peer_addresses_are_checked():
    good = "/ip4/127.0.0.1/tcp/31337/p2p/QmTchctY2mrWtDteP1QWQW79B2bLycdUvtDZ3airqiax6s"
    assert parse_initial_peers([good]) == [good]
    for bad in ("127.0.0.1:31337", "/ip4/127.0.0.1/tcp/31337", "/ip4/999.1.1.1/tcp/1/p2p/Qm"):
        with pytest.raises(BadPeerAddress) as info:
            parse_initial_peers([bad])
        assert bad in str(info.value)
