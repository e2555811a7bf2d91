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


def test_until_their_first_round_the_peers_status_lines_are_forwarded_and_a_silence_is_filled(monkeypatch):
    """Issue #68 item 4: the launcher prints each peer's status line as it comes, and when none
    came for HEARTBEAT_S, one line saying what each peer not yet training is doing; from every
    peer's first round on, only the rounds."""
    import json
    import threading
    import time

    from peer import swarm as swarm_module
    from peer.events import Event

    monkeypatch.setattr(swarm_module, "HEARTBEAT_S", 0.2)
    swarm = _swarm({"peer-0": _Child(0), "peer-1": _Child(0)})
    swarm.events = queue.Queue()

    def event(kind: str, **fields) -> Event:
        return Event.parse(json.dumps({"event": kind, "time": 0.0, **fields}))

    round_fields = dict(
        round=1, train_loss=2.5, tokens_per_s=100.0, group_size=2, sync_s=0.1, bytes_sent=0, bytes_received=0, peers=2
    )

    def feed() -> None:
        put = swarm.events.put
        put(("peer-0", event("status", message="peer join: loading torch and hivemind")))
        put(("peer-1", event("status", message="peer join: loading torch and hivemind")))
        put(("peer-0", event("status", message="building the model and starting the averager")))
        time.sleep(0.7)  # nothing for a while: the launcher says what each peer does
        put(("peer-0", event("round", **round_fields)))
        put(("peer-1", event("status", message="training: the first round starts")))
        time.sleep(0.5)
        put(("peer-1", event("round", **round_fields)))
        time.sleep(0.7)  # both train: a quiet spell between rounds is not filled
        put(("peer-1", event("status", message="re-synced")))  # after its first round: not forwarded
        put(("peer-0", None))
        put(("peer-1", None))

    threading.Thread(target=feed, daemon=True).start()
    out = io.StringIO()
    _watch(swarm, Console(file=out, width=300))
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        "peer-0 | peer join: loading torch and hivemind",
        "peer-1 | peer join: loading torch and hivemind",
        "peer-0 | building the model and starting the averager",
    ], lines
    waiting = [line for line in lines if line.startswith("local swarm: ")]
    assert waiting and waiting[0].startswith(
        "local swarm: 0/2 peer(s) finished a round; peer-0: building the model and starting the averager; "
        "peer-1: peer join: loading torch and hivemind ("
    ), lines
    first_round = next(i for i, line in enumerate(lines) if line.startswith("peer-0 | round 1 |"))
    assert lines.index(waiting[0]) < first_round
    after_all = next(i for i, line in enumerate(lines) if line.startswith("peer-1 | round 1 |"))
    between = lines[first_round:after_all]
    assert "peer-1 | training: the first round starts" in between, lines
    assert any(
        line.startswith("local swarm: 1/2 peer(s) finished a round; peer-1: training: the first round")
        for line in between
    )
    assert not [line for line in lines[after_all:] if line.startswith("local swarm: ") or "re-synced" in line], lines
