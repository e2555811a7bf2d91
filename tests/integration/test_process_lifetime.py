"""Nothing left behind: a peer's and a bootstrap node's helper processes (DHT, p2pd, averager) die
with it however it ends, every stop signal ends the command cleanly, and a helper that dies on
its own ends the command (exit 75) instead of leaving it hanging.

Real processes: `peer join` (tiny runs, one per test, on one shared bootstrap node) and `bootstrap
run`. A helper is found as a descendant of the command's process, recorded while it runs (after a
kill -9 its helpers are reparented and could no longer be told apart from anyone else's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.net.lifetime import children, proc_stat
from tests.integration.harness import PROJECT_ROOT, Procs, make_manifest, shared_memory_files, write_manifest

pytestmark = pytest.mark.integration

Proc = tuple[int, int, str]
"""(pid, start time in clock ticks, name): the start time tells a live process from a reused pid."""


def descendants(pid: int) -> list[Proc]:
    """Every process below ``pid``, children of all its threads included."""
    found = []
    for child in children(pid):
        stat = proc_stat(child)
        if stat is not None:
            found.append((child, stat[2], stat[0]))
            found += descendants(child)
    return found


def alive(procs: list[Proc]) -> list[Proc]:
    """Those of ``procs`` still running (a zombie has ended; a reused pid is another process)."""
    running = []
    for pid, start, name in procs:
        stat = proc_stat(pid)
        if stat is not None and stat[2] == start and stat[1] != "Z":
            running.append((pid, start, name))
    return running


def wait_until_gone(procs: list[Proc], timeout_s: float) -> list[Proc]:
    """Wait (bounded) until none of ``procs`` runs; return those still running then."""
    deadline = time.monotonic() + timeout_s
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(procs)


def stderr_of(child) -> str:
    return Path(child.log_path).read_text(errors="replace")


def send(child, sig: int, *, group: bool) -> None:
    """``sig`` to the command's process, or to its whole process group (what a terminal's Ctrl-C
    and a service manager's stop reach)."""
    if group:
        child.signal_group(sig)
    else:
        child.send(sig)


@pytest.fixture(scope="module")
def bootstrap_addr(tmp_path_factory):
    """One bootstrap node for the peer tests (each test runs its own tiny run through it)."""
    workdir = tmp_path_factory.mktemp("bootstrap")
    procs = Procs(workdir)
    try:
        _, addr = procs.bootstrap(write_manifest(workdir, make_manifest()))
        yield addr
    finally:
        procs.cleanup()


def start_peer(procs: Procs, tmp_path: Path, bootstrap_addr: str, name: str):
    """A peer on its own tiny run (so no test sees another's peers) that reached its first round,
    and the helper processes it runs."""
    run_file = write_manifest(tmp_path, make_manifest(name=f"tiny-lifetime-{name}"))
    peer = procs.peer(name, "--initial-peers", bootstrap_addr, "--run", str(run_file), "--new-run")
    peer.wait_event(lambda e: e.kind == "round", 180)
    helpers = descendants(peer.popen.pid)
    names = sorted(n for _, _, n in helpers)
    assert "p2pd" in names and len(helpers) >= 3, f"expected DHT, p2pd and averager processes, found {names}"
    return peer, helpers


def test_kill_9_takes_the_helpers_along_and_a_restart_works_at_once(procs, tmp_path, bootstrap_addr):
    peer, helpers = start_peer(procs, tmp_path, bootstrap_addr, "killed")
    pids = [peer.popen.pid, *(pid for pid, _, _ in helpers)]
    peer.send(signal.SIGKILL)
    assert peer.wait(30) == -signal.SIGKILL
    assert wait_until_gone(helpers, 30) == [], "helpers outlived the killed peer"
    # nor does its tensors' shared memory (RAM until a reboot, were it left in /dev/shm)
    assert shared_memory_files(pids) == [], "the killed peer left shared memory in /dev/shm"

    # Same data dir, so the same identity: refused while the old p2pd still held it.
    since = len(peer.events)
    peer.start()
    restarted = peer.wait_event(lambda e: e.kind == "round", 180, since=since)
    assert restarted.start == 2


def test_a_second_peer_on_a_data_dir_in_use_is_refused_and_the_first_trains_on(procs, tmp_path, bootstrap_addr):
    peer, _ = start_peer(procs, tmp_path, bootstrap_addr, "holder")
    second = procs.peer("holder", "--initial-peers", bootstrap_addr)  # the same --data-dir
    assert second.wait(60) == 78, second.tail()
    assert "is in use by another peer" in second.tail() and f"pid {peer.popen.pid}" in second.tail()
    since = len(peer.events)
    peer.wait_event(lambda e: e.kind == "round", 180, since=since)  # untouched by the refused one
    assert peer.popen.poll() is None


@pytest.mark.parametrize(
    "sig, group",
    [
        (signal.SIGINT, True),  # Ctrl-C in a terminal: the whole foreground process group
        (signal.SIGTERM, False),  # kill PID
        (signal.SIGTERM, True),  # kill -TERM -PGID; a service manager's stop, which then waits
    ],
    ids=["sigint-group", "sigterm-process", "sigterm-group"],
)
def test_a_stop_signal_checkpoints_and_exits_130_leaving_nothing(procs, tmp_path, bootstrap_addr, sig, group):
    peer, helpers = start_peer(procs, tmp_path, bootstrap_addr, f"{sig.name.lower()}-{'group' if group else 'proc'}")
    send(peer, sig, group=group)
    assert peer.wait(60) == 130, peer.tail()
    stopped = peer.last("stopped")
    assert stopped is not None and stopped["interrupted"]
    assert stopped["checkpoint"] and Path(stopped["checkpoint"]).is_file()
    assert "Traceback" not in stderr_of(peer), stderr_of(peer)
    assert wait_until_gone(helpers, 30) == [], "helpers outlived the stopped peer"


def helper_of(pid: int, which: str) -> Proc:
    """Peer ``pid``'s DHT process (its forked child with p2pd below it), its averager process (its
    forked child without), or the p2pd below its DHT process; ``which`` is "DHT", "averager" or
    "p2pd"."""
    if which == "p2pd":
        return next(h for h in descendants(helper_of(pid, "DHT")[0]) if h[2] == "p2pd")
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    mine = set(children(pid))
    found = []
    for child in (c for c in descendants(pid) if c[0] in mine):
        try:
            with open(f"/proc/{child[0]}/cmdline", "rb") as f:
                forked = f.read() == cmdline  # not torch's shm manager
        except OSError:
            continue
        if forked and ("p2pd" in [n for _, _, n in descendants(child[0])]) == (which == "DHT"):
            found.append(child)
    assert len(found) == 1, f"expected one {which} process below {pid}, found {found} in {descendants(pid)}"
    return found[0]


@pytest.mark.parametrize(
    "which, overlap", [("averager", "none"), ("averager", "delayed"), ("DHT", "none"), ("p2pd", "none")]
)
def test_a_peer_whose_helper_dies_checkpoints_exits_75_and_resumes(procs, tmp_path, bootstrap_addr, which, overlap):
    """A helper process killed (as the kernel's OOM killer does) while the peer trains with a
    groupmate: the peer neither hangs in its next sync nor at its exit, nor trains on cut off. It
    writes its checkpoint, exits 75 with one line naming the helper, leaves nothing running, its
    groupmate trains on, and run again it resumes from the checkpoint and syncs with the groupmate."""
    name = f"{which.lower()}-{overlap}"
    manifest = make_manifest(name=f"tiny-helper-death-{name}", sync={"inner_steps": 20, "overlap": overlap})
    run_file = write_manifest(tmp_path, manifest)
    a = procs.peer(
        f"dies-{name}", "--initial-peers", bootstrap_addr, "--run", str(run_file), "--new-run", "--wait-for-peers", "2"
    )
    a.wait_event(lambda e: e.kind == "started", 120)
    b = procs.peer(
        f"mate-{name}", "--initial-peers", bootstrap_addr, "--run-id", manifest.run_id, "--wait-for-peers", "2"
    )
    a.wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 240)
    helpers = descendants(a.popen.pid)
    victim = helper_of(a.popen.pid, which)
    os.kill(victim[0], signal.SIGKILL)

    assert a.wait(120) == 75, a.tail()
    log = stderr_of(a)
    how = "exited" if which == "p2pd" else "died with exit code -9"  # p2pd is the DHT process's child
    assert f"error: this peer's {which} process (pid {victim[0]}) {how}" in log, log
    assert "run the peer again" in log and "Traceback" not in log, log
    stopped = a.last("stopped")
    assert stopped is not None and stopped["interrupted"], a.tail()
    assert stopped["checkpoint"] and Path(stopped["checkpoint"]).is_file()
    assert wait_until_gone(helpers, 30) == [], "helpers outlived the peer whose helper died"

    b.wait_event(lambda e: e.kind == "round", 180, since=len(b.events))  # the groupmate trains on, alone
    assert b.alive
    since = len(a.events)
    a.start()
    resumed = a.wait_event(lambda e: e.kind == "resumed", 120, since=since)
    assert resumed["round"] == stopped["final_round"], (resumed, stopped)
    a.wait_event(lambda e: e.kind == "round" and e["group_size"] == 2, 240, since=since)


def start_bootstrap(procs: Procs, tmp_path: Path):
    boot, _ = procs.bootstrap(write_manifest(tmp_path, make_manifest()))
    helpers = descendants(boot.popen.pid)
    assert "p2pd" in [n for _, _, n in helpers] and len(helpers) >= 2, helpers
    return boot, helpers


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint-group", "sigterm-group"])
def test_bootstrap_stops_on_a_signal_to_its_group(procs, tmp_path, sig):
    boot, helpers = start_bootstrap(procs, tmp_path)
    send(boot, sig, group=True)
    assert boot.wait(60) == 130, boot.tail()
    assert "Traceback" not in stderr_of(boot), stderr_of(boot)
    assert "bootstrap node stopped" in stderr_of(boot)
    assert wait_until_gone(helpers, 30) == [], "helpers outlived the stopped bootstrap node"


def test_bootstrap_stops_when_every_process_of_its_unit_gets_sigterm(procs, tmp_path):
    """systemd's default stop (KillMode=control-group) signals p2pd too, so p2pd may be gone
    before the DHT process shuts down."""
    boot, helpers = start_bootstrap(procs, tmp_path)
    send(boot, signal.SIGTERM, group=True)
    for pid, _, _ in alive(helpers):
        os.kill(pid, signal.SIGTERM)
    assert boot.wait(60) == 130, boot.tail()
    assert "Traceback" not in stderr_of(boot), stderr_of(boot)
    assert wait_until_gone(helpers, 30) == [], "helpers outlived the stopped bootstrap node"


LATE_HELPER = """
import multiprocessing as mp, os, sys, time
from peer.net.lifetime import HelperProcess

class Late(HelperProcess, mp.context.ForkProcess):
    def run(self):  # the helper's own setup (HelperProcess.run) starts after its parent is gone
        parent = mp.parent_process().pid
        deadline = time.monotonic() + 60
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.05)
        super().run()

helper = Late(target=time.sleep, args=(600,), daemon=False)
helper.start()
with open(sys.argv[1], "w") as f:
    f.write(str(helper.pid))
os._exit(0)
"""


def test_a_helper_whose_parent_died_before_its_setup_ends_itself(tmp_path):
    pid_file, log = tmp_path / "helper.pid", tmp_path / "parent.log"
    with open(log, "wb") as out:  # a file, not a pipe: the helper inherits it and outlives the parent
        code = subprocess.run(
            [sys.executable, "-c", LATE_HELPER, str(pid_file)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            timeout=120,
            cwd=PROJECT_ROOT,
        ).returncode
    assert code == 0, log.read_text()
    pid = int(pid_file.read_text())
    stat = proc_stat(pid)
    helper = [(pid, stat[2], stat[0])] if stat is not None else []
    try:
        assert wait_until_gone(helper, 60) == [], "the helper outlived its parent"
    finally:
        for pid, _, _ in alive(helper):
            os.kill(pid, signal.SIGKILL)


def test_a_bootstrap_node_whose_dht_process_dies_exits_75_leaving_nothing(procs, tmp_path):
    boot, helpers = start_bootstrap(procs, tmp_path)
    dht = [h for h in helpers if "p2pd" in [n for _, _, n in descendants(h[0])]]  # p2pd runs below it
    assert len(dht) == 1, helpers
    os.kill(dht[0][0], signal.SIGKILL)
    assert boot.wait(60) == 75, boot.tail()
    log = stderr_of(boot)
    assert f"error: this bootstrap node's DHT process (pid {dht[0][0]}) died with exit code -9" in log, log
    assert "Traceback" not in log, log
    assert wait_until_gone(helpers, 30) == [], "helpers outlived the bootstrap node"


def test_kill_9_of_bootstrap_takes_its_dht_and_p2pd_along(procs, tmp_path):
    boot, helpers = start_bootstrap(procs, tmp_path)
    boot.send(signal.SIGKILL)
    assert boot.wait(30) == -signal.SIGKILL
    assert wait_until_gone(helpers, 30) == [], "helpers outlived the killed bootstrap node"
