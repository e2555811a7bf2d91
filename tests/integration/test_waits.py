"""No silent wait where a person waits (issue #53 item 4): what `bootstrap run`, `bootstrap monitor`
and `peer join` print, in text mode as a person sees them, from real processes on 127.0.0.1; and a
stopped peer leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from peer.net.lifetime import child_named, children
from protocol.signing import save_owner_key
from tests.integration.harness import OWNER, make_manifest, write_manifest

pytestmark = pytest.mark.integration


class TextProcess:
    """A command in its own process group whose stdout and stderr lines are kept in arrival order."""

    def __init__(self, *argv: str, cwd: Path):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=cwd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(s,), daemon=True) for s in (self.popen.stdout, self.popen.stderr)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream) -> None:
        with stream:
            for line in stream:
                with self._cond:
                    self.lines.append(line.rstrip("\n"))
                    self._cond.notify_all()

    def wait_line(self, pattern: str, timeout_s: float = 120.0) -> int:
        """The index of the first line matching ``pattern`` (waits for it; the timeout is a hang guard)."""
        rx, deadline = re.compile(pattern), time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, line in enumerate(self.lines):
                    if rx.search(line):
                        return i
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.popen.poll() is not None and not any(r.is_alive() for r in self._readers):
                    raise AssertionError(f"no line matching {pattern!r}; lines:\n" + "\n".join(self.lines))
                self._cond.wait(min(remaining, 0.5))

    def index(self, pattern: str) -> int:
        return next(i for i, line in enumerate(self.lines) if re.search(pattern, line))

    def stop(self) -> int:
        """SIGINT, wait for the exit (hang guard 60 s), return the exit code."""
        self.popen.send_signal(signal.SIGINT)
        code = self.popen.wait(60)
        for reader in self._readers:
            reader.join(10)
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait()
        for reader in self._readers:
            reader.join(10)


@pytest.fixture
def texts():
    started: list[TextProcess] = []
    yield started
    for proc in started:
        proc.kill()


def gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` is gone (or a zombie), polling until the hang guard."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def test_bootstrap_and_monitor_say_what_they_start_before_they_listen_and_stop_on_sigint(texts, tmp_path):
    run_file = write_manifest(tmp_path, make_manifest())
    owner = save_owner_key(OWNER, tmp_path / "owner.key").path
    boot = TextProcess(
        "bootstrap", "run", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"),
        "--run", str(run_file), "--owner-key", str(owner), cwd=tmp_path,
    )  # fmt: skip
    texts.append(boot)
    ready = boot.wait_line(r"peer join --initial-peers /ip4/127\.0\.0\.1/")
    starting = boot.index(r"bootstrap node: starting the DHT on 127\.0\.0\.1, any free port$")
    assert boot.index(r"bootstrap node: loading hivemind$") == 0 < starting, boot.lines
    assert starting < boot.index(r"bootstrap node \| run ") < ready, boot.lines
    addr = boot.lines[ready].split()[-1]

    mon = TextProcess("bootstrap", "monitor", "--initial-peers", addr, "--port", "0", cwd=tmp_path)
    texts.append(mon)
    page = mon.wait_line(r"swarm monitor: http://127\.0\.0\.1:\d+/")
    assert mon.index(r"swarm monitor: connecting to 1 node\(s\) of the swarm") == 0 < page, mon.lines
    assert mon.stop() == 130, mon.lines
    assert boot.stop() == 130, boot.lines


def test_a_peer_says_each_step_in_order_stops_on_sigint_leaving_no_process_and_restarts_without_a_warning(
    texts, tmp_path
):
    run_file = write_manifest(tmp_path, make_manifest(sync={"inner_steps": 400}))
    owner = save_owner_key(OWNER, tmp_path / "owner.key").path
    argv = (
        "peer", "join", "--run", str(run_file), "--owner-key", str(owner), "--data-dir", str(tmp_path / "peer"),
        "--host", "127.0.0.1", "--threads", "1",
    )  # fmt: skip
    peer = TextProcess(*argv, cwd=tmp_path)
    texts.append(peer)
    peer.wait_line(r"^round 1 \|", 300)
    order = [
        r"^peer join: loading torch and hivemind$",
        r"^reading the data of run ",
        r"^starting the DHT node on 127\.0\.0\.1",
        r"^locoswarm .* \| peer Qm",
        r"^training: ",
        r"^eval \(initial\) at round 0",
        r"^round 1 \|",
    ]
    assert [peer.index(p) for p in order] == sorted(peer.index(p) for p in order), peer.lines
    dht = next(c for c in children(peer.popen.pid) if child_named(c, "p2pd") is not None)
    p2pd = child_named(dht, "p2pd")
    helpers = children(peer.popen.pid)  # its DHT and averager processes
    assert p2pd is not None and len(helpers) >= 2

    assert peer.stop() == 130, peer.lines
    stopped = peer.index(r"^stopped after \d+ round\(s\); checkpoint /")
    assert peer.index(r"stopping after the current inner step") < stopped, peer.lines
    assert all(gone(pid) for pid in [*helpers, p2pd]), f"left running: {[*helpers, p2pd]}"

    reached = int(re.search(r"^stopped after (\d+) round", peer.lines[stopped]).group(1))  # from round 0
    again = TextProcess(*argv, "--max-rounds", str(reached + 1), cwd=tmp_path)
    texts.append(again)
    assert again.popen.wait(300) == 0, again.lines
    again.stop()  # joins its readers
    assert again.index(rf"^resumed from checkpoint .* at round {reached}, ") < again.index(
        rf"^round {reached + 1} \|"
    ), again.lines
    assert not [line for line in again.lines if "warning" in line.lower()], again.lines


def test_peer_swarm_says_what_its_peers_do_before_their_first_round(texts, tmp_path):
    """Issue #68 item 4: between "bootstrap node at" and the first round, the launcher forwards each
    peer's status lines (it read only their rounds before: 10 to 17 s of silence), in the order a
    peer goes through them. The seconds between lines are the bench's (bench/waits.py), not asserted."""
    swarm = TextProcess(
        "peer", "swarm", "--preset", "tiny", "--peers", "2", "--rounds", "1", "--workdir", str(tmp_path / "swarm"),
        cwd=tmp_path,
    )  # fmt: skip
    texts.append(swarm)
    first_round = swarm.wait_line(r"^peer-\d \| round 1 \|", 300)
    order = [
        r"^local swarm: reading the data of run tiny$",
        r"^local swarm: starting the bootstrap node$",
        r"^bootstrap node at /ip4/127\.0\.0\.1/",
        r"^peer-0 \| peer join: loading torch and hivemind$",
        r"^peer-0 \| starting the DHT node on ",
        r"^peer-0 \| looking for the swarm's run$",
        r"^peer-0 \| reading the (data of run|run's data)",
        r"^peer-0 \| building the model and starting the averager$",
        r"^peer-0 \| started: peer \w+ on cpu",
        r"^peer-0 \| training: ",
    ]
    at = [swarm.index(p) for p in order]
    assert at == sorted(at) and at[-1] < first_round, swarm.lines
    for peer in ("peer-0", "peer-1"):  # every peer's, not one peer's for all
        assert swarm.index(rf"^{peer} \| building the model") < first_round, swarm.lines
    assert swarm.popen.wait(300) == 0, swarm.lines
