"""The launcher (peer/launch.py) on small Python children: events, waits, signals, restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from peer.events import Event
from peer.launch import Child, stop_all
from protocol.errors import ChildExited, ChildTimeout

PRINTS = """
import json, sys, time
print("not json", flush=True)
print(json.dumps([1, 2]), flush=True)
print(json.dumps({"event": "started", "maddrs": ["/ip4/10.0.0.1/tcp/1/p2p/A", "/ip4/127.0.0.1/tcp/2/p2p/A"]}),
      flush=True)
time.sleep(float(sys.argv[1]))
print(json.dumps({"event": "round", "round": 3, "time": 12.5}), flush=True)
print("to the log", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[2]))
"""


def child(tmp_path, *args: str, **kw) -> Child:
    return Child("c", [sys.executable, "-c", PRINTS, *args], log_path=tmp_path / "c.log", cwd=tmp_path, **kw)


def test_events_are_the_json_objects_printed_with_typed_fields(tmp_path):
    c = child(tmp_path, "0.3", "0").start()
    started = c.wait_event(lambda e: e.kind == "started", 30)
    assert started.addresses_on("127.0.0.1") == ["/ip4/127.0.0.1/tcp/2/p2p/A"]
    later = c.wait_event(lambda e: e.kind == "round" and e.round >= 3, 30)
    assert (later.round, later.time, later["round"], later.get("note")) == (3, 12.5, 3, None)
    assert c.wait(30) == 0
    c.join_output()
    assert [e.kind for e in c.events] == ["started", "round"] and c.last("round") == later
    assert c.tail() == "to the log"


def test_output_ending_without_the_event_says_so_with_the_exit_code(tmp_path):
    c = child(tmp_path, "0", "3").start()
    with pytest.raises(ChildExited, match="exited \\(3\\)") as info:
        c.wait_event(lambda e: e.kind == "stopped", 30)
    assert info.value.returncode == 3


STUCK = """
import sys, threading, time
from peer.net.lifetime import dump_stacks_on_sigusr1
dump_stacks_on_sigusr1()
def waits_for_the_network():
    threading.Event().wait(60)
print("ready", file=sys.stderr, flush=True)
waits_for_the_network()
"""


def test_a_timeout_shows_where_the_child_waits(tmp_path):
    c = Child(
        "c", [sys.executable, "-c", STUCK], log_path=tmp_path / "c.log", cwd=tmp_path, stack_signal=signal.SIGUSR1
    ).start()
    deadline = time.monotonic() + 30
    while "ready" not in c.tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(ChildTimeout) as info:
        c.wait_event(lambda e: e.kind == "round", 0.2)
    assert "in waits_for_the_network" in str(info.value)
    assert c.alive  # the stack dump does not stop it
    c.kill()


def test_no_event_in_time_and_no_exit_in_time_raise_timeouts_with_the_log(tmp_path):
    c = child(tmp_path, "30", "0").start()
    with pytest.raises(ChildTimeout, match="no matching event within 0 s"):
        c.wait_event(lambda e: e.kind == "round", 0.3, since=1)
    with pytest.raises(ChildTimeout, match="still running"):
        c.wait(0.1)
    c.kill()
    assert c.returncode == -signal.SIGKILL


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_stop_all_kills_the_whole_process_group(tmp_path):
    script = (
        "import json, subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        "print(json.dumps({'event': 'spawned', 'pid': p.pid}), flush=True); time.sleep(60)"
    )
    c = Child("parent", [sys.executable, "-c", script], log_path=tmp_path / "p.log").start()
    grandchild = c.wait_event(lambda e: e.kind == "spawned", 30)["pid"]
    assert os.getpgid(c.popen.pid) == c.popen.pid == os.getpgid(grandchild)
    c.send(signal.SIGSTOP)  # ignores the grace time: stop_all kills it anyway
    stop_all([c], 0.2)
    assert c.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild)


def test_a_restart_numbers_its_events_and_spawn_can_wrap_the_command(tmp_path):
    calls, seen = [], []

    def spawn(argv, **popen):  # as lab.netlab.Host.run does with `ip netns exec`
        calls.append(popen["start_new_session"])
        return subprocess.Popen(["env", "LAUNCH_TEST=1", *argv], **popen)

    c = child(
        tmp_path,
        "0",
        "0",
        spawn=spawn,
        events_copy=tmp_path / "c.jsonl",
        on_event=lambda ch, e: seen.append(None if e is None else e.kind),
    )
    c.start().wait(30)
    c.join_output()
    c.start().wait(30)
    c.join_output()
    assert [e.start for e in c.of("round")] == [1, 2] and calls == [True, True]
    assert seen == ["started", "round", None] * 2
    assert (tmp_path / "c.jsonl").read_text().count("not json") == 2
    parsed = Event.parse(b'{"event": "eval"}', 2)
    assert (dict(parsed), parsed.start, Event.parse(b"[1]"), Event.parse(b"{")) == ({"event": "eval"}, 2, None, None)
