"""Child processes that print JSON event lines: start them, read their events, signal, stop.

`peer swarm`, the chaos harness (lab/chaos.py) and the integration tests start ``peer join
--log-format json`` and ``bootstrap run --log-format json`` through :class:`Child`:

* each child runs in its own process group (a terminal's Ctrl-C reaches only the launcher, and
  the whole group, the child's DHT and averager processes included, can be killed at once; p2pd
  runs in its own session and dies with the DHT process, peer/net/lifetime.py)
  and gets SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG, Linux);
* a thread reads its stdout; every line that is a JSON object becomes a :class:`peer.events.Event`;
  its stderr goes to a log file, whose tail error messages quote;
* ``spawn`` says how the process is created: ``subprocess.Popen`` by default, or e.g.
  :meth:`lab.netlab.Host.run` to start it inside a network namespace.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from peer.events import Event
from peer.net.lifetime import die_with_parent
from protocol.errors import ChildExited, ChildTimeout


class Child:
    """One child process and the events it printed; it may be started again after it exited.

    Args:
        name: names the child in messages.
        argv: the command (``sys.executable`` first for Python children; see peer_argv).
        log_path: the child's stderr (truncated at the first start, appended to at a restart).
        cwd: the child's working directory.
        spawn: ``spawn(argv, **popen_kwargs)`` creates the process; it must pass the keyword
            arguments on to ``subprocess.Popen`` (``start_new_session`` and ``preexec_fn`` among
            them).
        events_copy: also append every raw stdout line to this file.
        on_event: called from the reader thread with each event, then with None when the
            child's stdout closed.
        stack_signal: a signal that makes the child write its threads' stacks to its stderr
            (``peer``/``bootstrap`` commands: SIGUSR1, peer/net/lifetime.py
            ``dump_stacks_on_sigusr1``); sent when :meth:`wait_event` times out, so the error
            shows where the child waits. None: the error shows the log's tail only.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        cwd: Path | None = None,
        spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
        events_copy: Path | None = None,
        on_event: Callable[[Child, Event | None], None] | None = None,
        stack_signal: int | None = None,
    ):
        self.name, self.argv, self.log_path, self.cwd = name, list(argv), Path(log_path), cwd
        self.stack_signal = stack_signal
        self._spawn, self._events_copy, self._on_event = spawn, events_copy, on_event
        self.popen: subprocess.Popen | None = None
        self.starts = 0
        self._events: list[Event] = []
        self._cond = threading.Condition()
        self._ended_start = 0  # the last start whose stdout reached its end
        self._reader: threading.Thread | None = None

    # ---- process --------------------------------------------------------------------------
    def start(self, argv: Sequence[str] | None = None) -> Child:
        """Start the child (again, with ``argv`` if given); its events add to the same list.

        Raises:
            RuntimeError: it is still running.
        """
        if self.alive:
            raise RuntimeError(f"{self.name} is still running")
        if argv is not None:
            self.argv = list(argv)
        self.starts += 1
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb" if self.starts == 1 else "ab") as log:
            self.popen = self._spawn(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                env=env,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),
            )
        self._reader = threading.Thread(
            target=self._read, args=(self.popen, self.starts), daemon=True, name=f"launch-read-{self.name}"
        )
        self._reader.start()
        return self

    def _read(self, popen: subprocess.Popen, start: int) -> None:
        assert popen.stdout is not None
        copy = open(self._events_copy, "ab") if self._events_copy is not None else None
        try:
            for raw in popen.stdout:
                if copy is not None:
                    copy.write(raw)
                    copy.flush()
                event = Event.parse(raw, start)
                if event is None:
                    continue
                with self._cond:
                    self._events.append(event)
                    self._cond.notify_all()
                if self._on_event is not None:
                    self._on_event(self, event)
        finally:
            popen.stdout.close()
            if copy is not None:
                copy.close()
            with self._cond:
                self._ended_start = max(self._ended_start, start)
                self._cond.notify_all()
            if self._on_event is not None:
                self._on_event(self, None)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code of the latest start (None while it runs or before the first start)."""
        return None if self.popen is None else self.popen.poll()

    def send(self, sig: int) -> None:
        """Send ``sig`` to the child's own process only (SIGINT: finish the step, checkpoint, exit)."""
        if self.popen is not None and self.alive:
            try:
                os.kill(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (its DHT and averager too; p2pd follows its
        DHT process when that dies)."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the child to exit and (up to 5 s more) for its last events; returns its exit code.

        Raises:
            ChildTimeout: still running after ``timeout_s`` (the message has the log's tail).
        """
        assert self.popen is not None, "wait() before start()"
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ChildTimeout(f"{self.name} still running after {timeout_s:.0f} s; log tail:\n{self.tail()}") from None
        self.join_output(5.0)
        return code

    def kill(self) -> None:
        """SIGKILL the whole process group and reap the child."""
        self.signal_group(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()

    def join_output(self, timeout_s: float = 10.0) -> None:
        """Wait until the reader has taken in all the child printed (its stdout closed)."""
        if self._reader is not None:
            self._reader.join(timeout_s)

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the child's stderr log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---- events ---------------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        """Every event so far, of every start, in order (a copy)."""
        with self._cond:
            return list(self._events)

    def of(self, kind: str) -> list[Event]:
        with self._cond:
            return [e for e in self._events if e.kind == kind]

    def last(self, kind: str, **match: Any) -> Event | None:
        """The latest event of ``kind`` whose fields equal ``match``."""
        with self._cond:
            for event in reversed(self._events):
                if event.kind == kind and all(event.get(k) == v for k, v in match.items()):
                    return event
        return None

    def wait_event(self, predicate: Callable[[Event], bool], timeout_s: float, *, since: int = 0) -> Event:
        """The first event from index ``since`` on (past or future) that satisfies ``predicate``.

        Raises:
            ChildTimeout: none within ``timeout_s``.
            ChildExited: the current start's output ended without one.
        """
        assert self.popen is not None, "wait_event() before start()"
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for event in self._events[since:]:
                    if predicate(event):
                        return event
                since = len(self._events)
                ended = self._ended_start >= self.starts
                remaining = deadline - time.monotonic()
                if ended or remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.5))
        if ended:
            try:
                code = self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            raise ChildExited(f"{self.name} exited ({code}) before the event; log tail:\n{self.tail()}", code)
        lines = 40
        if self.stack_signal is not None and self.alive:
            try:
                os.kill(self.popen.pid, self.stack_signal)
                time.sleep(2.0)  # faulthandler writes at once; give the log a moment
                lines = 300
            except ProcessLookupError:
                pass
        raise ChildTimeout(
            f"{self.name}: no matching event within {timeout_s:.0f} s (alive={self.alive}); "
            f"log tail:\n{self.tail(lines)}"
        )


def stop_all(children: Iterable[Child], grace_s: float) -> None:
    """Give every child until ``grace_s`` from now to exit, then SIGKILL each one's process group.

    Leaves every child reaped and its output read (so its last events are in ``events``).
    """
    children = list(children)
    deadline = time.monotonic() + grace_s
    for child in children:
        if child.popen is not None:
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for child in children:
        child.kill()  # the child's DHT and averager too (p2pd dies with its DHT process), even where the child exited
    deadline = time.monotonic() + 10.0
    for child in children:
        child.join_output(max(0.1, deadline - time.monotonic()))


def peer_argv(*, data_dir: Path, initial_peers: Iterable[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """``peer join --log-format json`` with this interpreter."""
    return [
        sys.executable,
        "-m",
        "peer",
        "join",
        "--data-dir",
        str(data_dir),
        "--log-format",
        "json",
        *[a for p in initial_peers for a in ("--initial-peers", p)],
        *extra,
    ]


def bootstrap_argv(
    *, identity: Path, run: Path, host: str = "127.0.0.1", port: int = 0, extra: Sequence[str] = ()
) -> list[str]:
    """``bootstrap run --log-format json`` with this interpreter (port 0: any free port)."""
    return [
        sys.executable,
        "-m",
        "bootstrap",
        "run",
        "--host",
        host,
        "--port",
        str(port),
        "--identity",
        str(identity),
        "--run",
        str(run),
        "--log-format",
        "json",
        *extra,
    ]
