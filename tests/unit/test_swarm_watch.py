"""`peer swarm`'s watcher (peer/swarm.py ``_watch``): the first peer that fails stops the others, and
a peer killed by a signal is reported by the signal's name with the shell's exit code (128 + it)."""

import io
import queue
import subprocess
import sys
from types import SimpleNamespace

from rich.console import Console

from peer.swarm import SwarmConfig, _signal_name, _watch, build_summary


class _Child:
    """A real finished process standing in for a peer (``wait`` and ``tail`` as peer.launch.Child)."""

    def __init__(self, code: int, stderr: str = ""):
        script = f"import os, sys; sys.stderr.write({stderr!r}); sys.stderr.flush(); "
        script += f"os.kill(os.getpid(), {-code})" if code < 0 else f"sys.exit({code})"
        self.proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        self.log_path = "/tmp/peer.log"

    def wait(self) -> int:
        return self.proc.returncode

    def tail(self, _lines: int) -> str:
        return self.proc.stderr


def _swarm(children: dict) -> SimpleNamespace:
    events = queue.Queue()
    for name in children:
        events.put((name, None))  # each peer's output ended
    swarm = SimpleNamespace(children=children, events=events, failure=None, interrupted=0)
    swarm.interrupt = lambda: setattr(swarm, "interrupted", swarm.interrupted + 1)
    return swarm


def test_a_peer_killed_by_sigkill_is_named_with_exit_code_137():
    swarm = _swarm({"peer-0": _Child(-9)})
    out = io.StringIO()
    _watch(swarm, Console(file=out, width=200))
    assert swarm.failure == ("peer-0", 137, "killed by SIGKILL; no error line; see /tmp/peer.log")
    assert swarm.interrupted == 1
    assert "peer-0 exited with code 137: killed by SIGKILL" in out.getvalue()


def test_a_peer_that_exits_with_an_error_keeps_its_code_and_line_and_only_the_first_failure_counts():
    swarm = _swarm(
        {
            "peer-0": _Child(78, "error: manifest field sync.inner_steps = 0 is invalid\n"),
            "peer-1": _Child(1),
            "peer-2": _Child(0),
        }
    )
    _watch(swarm, Console(file=io.StringIO()))
    assert swarm.failure == ("peer-0", 78, "manifest field sync.inner_steps = 0 is invalid")
    assert swarm.interrupted == 1


def test_signal_names():
    assert (_signal_name(9), _signal_name(15), _signal_name(99)) == ("SIGKILL", "SIGTERM", "signal 99")


def test_shell_exit_maps_a_signal_death_and_keeps_other_codes():
    from peer.swarm import shell_exit

    assert shell_exit(-15, "see log") == (143, "killed by SIGTERM; see log")
    assert shell_exit(78, "bad manifest") == (78, "bad manifest")


def test_the_summary_gives_the_exit_code_the_error_line_gives():
    """The summary table and JSON say 137 for a peer killed by SIGKILL, as the error line does."""

    class Finished:
        events: list = []

        def __init__(self, code):
            self.returncode = code

        def of(self, _kind):
            return []

        def last(self, _kind, **_match):
            return None

    swarm = SimpleNamespace(
        children={"bootstrap": Finished(0), "peer-0": Finished(-9), "peer-1": Finished(130), "peer-2": Finished(None)},
        workdir="/tmp/w",
    )
    summary = build_summary(swarm, SwarmConfig(), 1.0)
    assert [p["exit_code"] for p in summary["peers"]] == [137, 130, None]
