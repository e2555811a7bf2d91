"""peer.sync.suspicion_store: the groupmates a peer leaves out or names survive its restart, and a
file that is corrupt, oversized or holds bad entries never stops the peer nor plants anything."""

from __future__ import annotations

import json
import logging
import os

import pytest
from hivemind.p2p import PeerID

import peer.sync.suspicion_store as store
from peer.sync.pieces import SUSPECT_ROUNDS, Suspects
from peer.sync.screening import EQUIVOCATOR_IGNORE_ROUNDS, IGNORE_ROUNDS, Strikes
from peer.sync.suspicion_store import GroupmateMemory, MemoryFile, SuspectMemory

A = PeerID(bytes([0x12, 0x20]) + bytes(range(32)))  # a sha2-256 multihash: "Qm…", as libp2p writes ids
B = PeerID(bytes([0x12, 0x20]) + bytes(range(100, 132)))


def caught(round_: int = 10) -> tuple[Strikes, Strikes]:
    """A's strikes ran out at ``round_`` (left out for IGNORE_ROUNDS); B equivocated at ``round_``."""
    strikes, distrust = Strikes(), Strikes()
    assert strikes.record(round_ - 2, [A]) == [] and strikes.record(round_ - 1, [A]) == []
    assert strikes.record(round_, [A]) == [A]
    distrust.ignore(B, round_, EQUIVOCATOR_IGNORE_ROUNDS)
    return strikes, distrust


def test_a_restarted_averager_leaves_out_the_same_groupmates_until_their_rounds_run_out(tmp_path):
    path = tmp_path / store.GROUPMATES_FILE
    GroupmateMemory(path).save(*caught(10))
    assert json.loads(path.read_text()) == {
        "version": 1,
        "ignored": {str(A): 11 + IGNORE_ROUNDS},
        "equivocators": {str(B): 11 + EQUIVOCATOR_IGNORE_ROUNDS},
    }
    strikes, distrust = GroupmateMemory(path).recall()  # a new process, a new memory
    assert strikes.ignored(11) == {A} and strikes.ignored(10 + IGNORE_ROUNDS) == {A}  # hivemind PeerIDs again
    assert strikes.ignored(11 + IGNORE_ROUNDS) == set()
    assert all(distrust.ignored(r) == {B} for r in (11, 5_000, 10 + EQUIVOCATOR_IGNORE_ROUNDS))
    assert not distrust.is_ignored(A, 11) and not strikes.is_ignored(B, 11)


def test_a_restarted_host_names_the_same_owners_until_their_rounds_run_out(tmp_path):
    path = tmp_path / store.SUSPECTS_FILE
    suspects = Suspects()
    suspects.add([str(A)], 5, proven=[str(A)])
    suspects.add([str(B)], 7, proven=[str(B)])
    SuspectMemory(path).save(suspects)
    restored = Suspects()
    SuspectMemory(path).restore(restored)
    assert restored.named(6) == sorted([str(A), str(B)])
    assert restored.named(5 + SUSPECT_ROUNDS) == [str(B)] and restored.named(7 + SUSPECT_ROUNDS) == []


def test_nothing_unproven_is_kept_across_a_restart(tmp_path):
    """An owner skipped by a majority's refusals (or its alignment) is named while the process runs;
    only a proven equivocator is named again after a restart (issue #65, item 1)."""
    path = tmp_path / store.SUSPECTS_FILE
    suspects = Suspects()
    suspects.add([str(A), str(B)], 5, proven=[str(B)])
    assert suspects.named(6) == sorted([str(A), str(B)])
    SuspectMemory(path).save(suspects)
    restored = Suspects()
    SuspectMemory(path).restore(restored)
    assert restored.named(6) == [str(B)]


def test_the_file_is_written_only_when_what_it_holds_changed(tmp_path):
    path = tmp_path / "run" / store.GROUPMATES_FILE  # the run directory is made if missing
    memory = GroupmateMemory(path)
    strikes, distrust = caught(10)
    memory.save(strikes, distrust)
    path.unlink()
    memory.save(strikes, distrust)  # nothing new: no write
    assert not path.exists()
    strikes.ignore(B, 12)
    memory.save(strikes, distrust)
    assert set(json.loads(path.read_text())["ignored"]) == {str(A), str(B)}
    assert [p.name for p in path.parent.iterdir()] == [store.GROUPMATES_FILE]  # no temporary left


def test_no_file_is_no_memory_and_no_warning(tmp_path, caplog):
    strikes, distrust = GroupmateMemory(tmp_path / "absent.json").recall()
    assert strikes.ignored(0) == set() and distrust.ignored(0) == set()
    GroupmateMemory(None).save(*caught())  # a peer without a run directory keeps nothing
    assert not caplog.records and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe\x00garbage",
        b"",
        b"[1, 2, 3]",
        b'{"version": 2, "ignored": {}}',
        b'{"ignored": {}}',
        b"[" * 200_000,  # nesting deeper than the parser's recursion
        b'{"version": 1, "ignored": {"Qm": ' + b"9" * 5_000 + b"}}",  # past Python's int digits limit
    ],
)
def test_a_corrupt_file_is_a_warning_and_no_memory(tmp_path, caplog, content):
    path = tmp_path / store.GROUPMATES_FILE
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=store.__name__):
        strikes, distrust = GroupmateMemory(path).recall()
    assert strikes.ignored(0) == set() and distrust.ignored(0) == set()
    assert "ignoring" in caplog.text and str(path) in caplog.text
    memory = GroupmateMemory(path)  # and the next save replaces it
    memory.recall()
    memory.save(*caught())
    assert json.loads(path.read_text())["version"] == 1


def test_an_unreadable_file_is_a_warning(tmp_path, caplog):
    path = tmp_path / store.SUSPECTS_FILE
    path.mkdir()  # reading a directory fails as a permission error would
    suspects = Suspects()
    SuspectMemory(path).restore(suspects)
    assert suspects.named(0) == [] and "ignoring" in caplog.text


def test_an_oversized_file_is_not_read(tmp_path, caplog, monkeypatch):
    path = tmp_path / store.GROUPMATES_FILE
    GroupmateMemory(path).save(*caught())
    monkeypatch.setattr(store, "MAX_FILE_BYTES", path.stat().st_size - 1)
    strikes, distrust = GroupmateMemory(path).recall()
    assert strikes.ignored(11) == set() and distrust.ignored(11) == set()
    assert "more than the" in caplog.text


def test_bad_entries_are_dropped_and_the_good_ones_kept(tmp_path, caplog):
    path = tmp_path / store.GROUPMATES_FILE
    bad = {
        "": 5,
        "Q" * (store.MAX_PEER_ID_CHARS + 1): 5,
        "Qm0OIl": 5,  # not base58
        "Qm/../x": 5,
        "QmNegative": -1,
        "QmFloat": 5.0,
        "QmBool": True,
        "QmText": "5",
        "QmNull": None,
        "QmList": [5],
        "QmHuge": store.MAX_ROUND + 1,
    }
    path.write_text(json.dumps({"version": 1, "ignored": {**bad, str(A): 30}, "equivocators": ["not", "a", "map"]}))
    strikes, distrust = GroupmateMemory(path).recall()
    assert strikes.ignored(29) == {A} and distrust.ignored(0) == set()
    assert f"dropped {len(bad) + 1} entries" in caplog.text


def test_a_section_keeps_the_entries_that_run_out_last(tmp_path):
    path = tmp_path / store.SUSPECTS_FILE
    n = store.MAX_ENTRIES + 500
    ids = [str(PeerID(bytes([0x12, 0x20]) + i.to_bytes(32, "big"))) for i in range(n)]
    path.write_text(json.dumps({"version": 1, "suspects": {p: 1000 + i for i, p in enumerate(reversed(ids))}}))
    loaded = MemoryFile(path, ("suspects",)).load()["suspects"]
    assert len(loaded) == store.MAX_ENTRIES and min(loaded.values()) == 1500  # the 500 oldest forgotten
    memory = GroupmateMemory(tmp_path / store.GROUPMATES_FILE, key=str)
    distrust = Strikes()
    for i, p in enumerate(ids):
        distrust.ignore(p, i, 0)
    memory.save(Strikes(), distrust)  # a save is capped the same way
    saved = json.loads(memory.file.path.read_text())["equivocators"]
    assert len(saved) == store.MAX_ENTRIES and set(saved) == set(ids[500:])


def test_a_failed_write_is_a_warning_and_leaves_the_old_file(tmp_path, caplog):
    path = tmp_path / store.GROUPMATES_FILE
    GroupmateMemory(path).save(*caught())
    before = path.read_bytes()
    memory = GroupmateMemory(path)
    memory.recall()
    (tmp_path / f".{path.name}.tmp{os.getpid()}").mkdir()  # the temporary cannot be opened
    strikes, distrust = caught()
    strikes.ignore(B, 50)
    memory.save(strikes, distrust)  # no exception
    assert path.read_bytes() == before and "could not keep" in caplog.text
