"""Random and mutated messages into every decoder and handler of what peers send (issue #17 item 5).

The same targets and mutations as bench/fuzz.py (lab/fuzz.py, lab/fuzz_targets.py), with fewer
messages: a few thousand per decoder, fewer per handler, about half a minute in all here. Each
target must refuse with its documented exceptions only (no crash), answer every message within
lab/fuzz.py ``HANG_S`` (no hang) and keep this process's memory flat.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # lab/ is repo tooling, not installed
from lab import fuzz
from lab.fuzz_targets import close_loops, decoders, handlers
from peer.net import dht as swarm_dht
from protocol import keys
from protocol.records import ProgressRecord
from protocol.signing import PeerSigner
from tests.security.fake_dht import FakeDHT

pytestmark = pytest.mark.timeout(240)

DECODER_MESSAGES = 3000
HANDLER_MESSAGES = {"state downloader (download_state)": 800, "all-reduce stream (GroupAllreduce.serve)": 300}
"""Handlers get 2,000 messages, these two fewer: each of their messages is a whole exchange."""
MEMORY_MB = 20.0
"""Growth of the process over a run that counts as not flat (a leak of 10 KB per message would
show as 30 MB on a decoder's run)."""

_TARGETS = {t.name: t for t in decoders() + handlers()}


@pytest.fixture(autouse=True)
def _close_the_targets_event_loops():
    yield
    close_loops()


def _params():
    for name in _TARGETS:
        yield pytest.param(name, id=name.split(" (")[0].replace(" ", "-"))


@pytest.mark.parametrize("name", list(_params()))
def test_no_message_crashes_hangs_or_grows_memory(name):
    target = _TARGETS[name]
    count = HANDLER_MESSAGES.get(name, 2000 if name in {t.name for t in handlers()} else DECODER_MESSAGES)
    result = fuzz.run(target, count, seed=17)
    assert result.messages == count
    assert result.crashes == 0, result.first_crash
    assert result.hangs == 0
    assert result.memory_growth_mb < MEMORY_MB


def test_the_mutations_reach_past_the_first_check():
    """A fuzzer whose every message dies at the first byte tests nothing: most decoders must also
    accept some mutated messages, and refuse others."""
    for name in ("all-reduce HELLO", "state REQUEST", "codec decode (every format)", "wire frame (framing.read_frame)"):
        result = fuzz.run(_TARGETS[name], 1000, seed=3)
        assert 0 < result.refused < result.messages, (name, result)


def test_a_validly_signed_record_that_breaks_the_decoder_hides_no_other_record():
    """Found by fuzzing: a record its writer signed correctly whose body has a bytes key made
    ``ProgressRecord.from_wire`` raise TypeError, and ``read_progress`` with it: every peer then kept
    the records of its last good read for as long as the attacker's record lived."""
    run_id = "fuzzrun"
    key = keys.progress_key(run_id)
    honest, attacker = (PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=2048)) for _ in range(2))
    record = ProgressRecord(
        round=3, inner_step=30, train_loss=3.0, tokens_per_s=100.0, group_size=2, bytes_sent=10, state_digest="a" * 32
    )
    dht, expiration = FakeDHT(), 1.9e9
    dht.store(key, honest.seal(key, expiration, record.to_wire()), expiration_time=expiration, subkey=honest.peer_id)
    poisoned = {**record.to_wire(), b"x": 1}
    envelope = attacker.seal(key, expiration, poisoned)
    assert msgpack.unpackb(envelope["b"], raw=False, strict_map_key=True)[b"x"] == 1  # it survives the DHT's checks
    dht.store(key, envelope, expiration_time=expiration, subkey=attacker.peer_id)
    records = swarm_dht.read_progress(dht, run_id, max_ttl_s=1e9)
    assert [r.peer_id for r in records] == [honest.peer_id]
    assert dataclasses.astuple(records[0].record) == dataclasses.astuple(record)
