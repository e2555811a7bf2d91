"""Bad input a new user meets (issue #68, item 7): a taken --port is named (exit 78), a wrong --run-id
lists the runs the swarm has, a checkpoint the peer cannot use is moved aside (never overwritten),
and a disk too small for two checkpoints and the shard cache is refused before training.

The same through real `peer join` processes: tests/integration/test_join_errors_and_signals.py (the
port) and tests/integration/test_right_run.py (the run id)."""

from __future__ import annotations

import socket
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab.inprocess import InProcessHub, InProcessSwarm, InProcessTransport
from peer.config import TrainerConfig
from peer.net.dht_node import check_port_free
from peer.round import Trainer, checkpointing
from peer.run_choice import MAX_RUNS_LISTED, refuse_unannounced_run_id
from peer.state.checkpoint import load_checkpoint, move_aside
from peer.state.disk import DiskNeed, check_disk_space, checkpoint_need, shard_cache_need
from peer.train.model import build_model
from protocol.errors import CheckpointError, ConfigError, RunChoiceNeeded
from protocol.presets import tiny_run
from tests.unit.sim_fixtures import Events, corpus, one_thread  # noqa: F401 (fixtures)

GB = 10**9


# --port


def test_a_port_another_process_listens_on_is_refused_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port {port}: TCP port {port} on 127.0.0.1 is in use") as err:
            check_port_free("127.0.0.1", port, wait_s=0.0)
    assert err.value.exit_code == 78 and "--port 0" in str(err.value)


def test_a_free_port_and_port_0_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_free("127.0.0.1", port, wait_s=0.0)  # closed again: free
    check_port_free("127.0.0.1", 0, wait_s=0.0)


def test_a_host_that_is_not_this_machines_is_named():
    with pytest.raises(ConfigError, match="--host 192.0.2.1: not an address of this machine"):
        check_port_free("192.0.2.1", 31337, wait_s=0.0)


# --run-id


def test_a_run_id_the_swarm_does_not_announce_lists_the_runs_it_does():
    a, b = tiny_run().replace(name="alpha"), tiny_run().replace(name="beta")
    announced = {"aa" * 16: a, "bb" * 16: b}
    with pytest.raises(RunChoiceNeeded) as err:
        refuse_unannounced_run_id("cc" * 16, announced)
    line = str(err.value)
    assert f"--run-id {'cc' * 16}: the swarm announces no such run" in line
    assert f"'alpha' (run id {'aa' * 16})" in line and f"'beta' (run id {'bb' * 16})" in line
    assert err.value.exit_code == 64


def test_the_run_id_announced_or_nothing_read_yet_is_no_refusal():
    refuse_unannounced_run_id("aa" * 16, {"aa" * 16: tiny_run()})
    refuse_unannounced_run_id("aa" * 16, {})  # a swarm still starting: the caller waits on


def test_many_runs_are_listed_up_to_the_cap_and_counted():
    announced = {f"{i:032x}": tiny_run().replace(name=f"run{i}") for i in range(MAX_RUNS_LISTED + 3)}
    with pytest.raises(RunChoiceNeeded, match=" and 3 more: pass one of these ids") as err:
        refuse_unannounced_run_id("f" * 32, announced)
    assert str(err.value).count("(run id ") == MAX_RUNS_LISTED


# a checkpoint the peer cannot use


def test_move_aside_keeps_the_bytes_and_never_overwrites(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    now = datetime(2026, 12, 6, 3, 4, 5, tzinfo=UTC)
    path.write_bytes(b"first")
    first = move_aside(path, now=now)
    path.write_bytes(b"second")
    second = move_aside(path, now=now)  # the same second: a new name, the first file untouched
    assert first.name == "checkpoint.safetensors.corrupt-20261206T030405Z"
    assert second.name == "checkpoint.safetensors.corrupt-20261206T030405Z-1"
    assert (first.read_bytes(), second.read_bytes()) == (b"first", b"second")
    assert not path.exists()


def trainer(corpus, manifest, checkpoint, reporter):
    return Trainer(
        manifest=manifest,
        model=build_model(manifest.model, corpus.tokenizer),
        corpus=corpus,
        swarm=InProcessSwarm("a", InProcessHub()),
        transport=InProcessTransport("a"),
        config=TrainerConfig(max_rounds=1, checkpoint_path=checkpoint, eval_every_rounds=0),
        reporter=reporter,
        stop_event=threading.Event(),
    )


@pytest.mark.usefixtures("one_thread")
def test_a_corrupt_checkpoint_is_moved_aside_reported_and_a_fresh_one_written(corpus, tmp_path):
    manifest, path = tiny_run(), tmp_path / "checkpoint.safetensors"
    garbage = b"\x00" * 7 + b"not a safetensors file"
    path.write_bytes(garbage)
    reporter = Events()
    t = trainer(corpus, manifest, path, reporter)
    t.run()
    t.save()
    (moved,) = tmp_path.glob("checkpoint.safetensors.corrupt-*")
    assert moved.read_bytes() == garbage  # the user's file, as it was
    (warning,) = [e["message"] for e in reporter.of("warning") if "checkpoint" in e["message"]]
    assert f"checkpoint {path} is unreadable" in warning and f"moved to {moved}" in warning, warning
    assert not reporter.of("resumed")
    assert load_checkpoint(path, run_id=manifest.run_id, names=t.names, shapes=t.shapes).round == 1


@pytest.mark.usefixtures("one_thread")
def test_a_corrupt_checkpoint_that_cannot_be_moved_stops_the_peer_and_stays_as_it_was(corpus, tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.safetensors"
    path.write_bytes(b"garbage")

    def refuse(p):
        raise CheckpointError(f"cannot move checkpoint {p} aside: Permission denied")

    monkeypatch.setattr(checkpointing, "move_aside", refuse)
    t = trainer(corpus, tiny_run(), path, Events())
    with pytest.raises(ConfigError, match="Permission denied: move it away yourself") as err:
        t.run()
    assert err.value.exit_code == 78 and path.read_bytes() == b"garbage"


# free disk space


def usage(free_bytes):
    return lambda path: SimpleNamespace(total=100 * GB, used=0, free=free_bytes)


def test_a_disk_short_of_two_checkpoints_is_refused_naming_the_directory_and_both_sizes(tmp_path):
    need = checkpoint_need(tmp_path / "runs" / "r" / "checkpoint.safetensors", int(2.5 * GB))
    with pytest.raises(ConfigError) as err:
        check_disk_space([need], disk_usage=usage(3 * GB))
    line = str(err.value)
    assert f"{tmp_path / 'runs' / 'r'} has 3.0 GB free, this peer needs 5.0 GB there" in line, line
    assert "2 checkpoints of 2.50 GB" in line and "--data-dir" in line
    assert err.value.exit_code == 78
    check_disk_space([need], disk_usage=usage(5 * GB))  # enough


def test_the_checkpoint_held_now_and_the_shards_held_now_count_as_room(tmp_path):
    checkpoint = tmp_path / "checkpoint.safetensors"
    checkpoint.write_bytes(b"x" * 1000)
    assert checkpoint_need(checkpoint, 1000).need_bytes == 1000  # the new one beside the old
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.parquet").write_bytes(b"x" * 300)
    assert shard_cache_need(shards, cap_bytes=2000, run_bytes=5000).need_bytes == 1700
    assert shard_cache_need(shards, cap_bytes=2000, run_bytes=800).need_bytes == 500  # the run is smaller


def test_needs_on_one_disk_add_up_and_the_message_names_each_and_its_fix(tmp_path):
    checkpoint = checkpoint_need(tmp_path / "data" / "checkpoint.safetensors", 1 * GB)
    shards = shard_cache_need(tmp_path / "cache" / "shards", cap_bytes=20 * GB, run_bytes=50 * GB)
    check_disk_space([checkpoint], disk_usage=usage(21 * GB))  # each alone fits
    check_disk_space([shards], disk_usage=usage(21 * GB))
    with pytest.raises(ConfigError) as err:
        check_disk_space([checkpoint, shards], disk_usage=usage(21 * GB))
    line = str(err.value)
    assert "has 21.0 GB free, this peer needs 22.0 GB there" in line, line
    assert "20.0 GB for the run's shards (--data-cache-gb 20" in line and "lower --data-cache-gb" in line


def test_a_need_of_nothing_is_never_refused(tmp_path):
    check_disk_space([DiskNeed(directory=tmp_path, need_bytes=0, what="x", fix="y")], disk_usage=usage(0))
    with pytest.raises(ValueError, match="need_bytes = -1"):
        DiskNeed(directory=Path(tmp_path), need_bytes=-1, what="x", fix="y")
