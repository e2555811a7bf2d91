"""Process lifetime: helper processes die with the process that started them, and a command stops
once, cleanly, on Ctrl-C or a service manager's SIGTERM.

The processes of ``peer join`` (``bootstrap run`` has no averager)::

    main process          StopOnSignal: the first SIGINT/SIGTERM sets an event, a second exits now
    ├── DHT process       fork (HelperProcess): ignores SIGINT/SIGTERM, SIGKILL when main dies
    │   └── p2pd          fork+exec from the DHT process: own session, SIGINT ignored,
    │                     SIGTERM when the DHT process dies
    └── averager process  fork (HelperProcess): ignores SIGINT/SIGTERM, SIGKILL when main dies

A helper that dies on its own while the command runs (the kernel's OOM killer, most often) is
seen by :class:`HelperWatch` within a second: the command stops as on a signal (a peer writes its
checkpoint) and exits 75 with one line naming the helper (:class:`~protocol.errors.HelperDied`);
every wait on a helper also checks that it is alive, so none waits forever.

A terminal's Ctrl-C and ``kill -TERM -PGID`` reach every process of the group. The helpers leave
such a signal to the main process, whose stop path shuts them down in order (p2pd is not even in
the group); a helper that acted on it itself would pull the DHT or the averager away under a
clean stop. When the main process dies in any way (``kill -9`` included) the kernel kills its
helpers (``PR_SET_PDEATHSIG``, Linux), and p2pd dies with the DHT process: nothing is left that
would hold the peer's identity, so a restart with the same data dir works at once.

The parent-death signal fires when the *thread* that forked the child exits, so a DHT or an
averager must be started from a thread that outlives it (the main thread, in our commands).
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Any

from protocol.errors import HelperDied

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

try:  # looked up at import, in the parent: loading a library between fork and exec is not safe
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` writes every thread's Python stack to this process's stderr (the peer's
    log) and the process goes on: how to see where a peer that stopped making progress waits.
    Helper processes forked afterwards inherit it. A no-op where SIGUSR1 does not exist or stderr
    is not a file (a test's captured output)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both OSError and ValueError
        pass


def quiet_handshakes_cut_by_a_dead_helper() -> None:
    """A helper killed while it fetched a file descriptor from this process (torch passes shared
    tensors' descriptors through multiprocessing's resource sharer) breaks the sharer thread's
    handshake with ``ConnectionResetError``; the thread survives it, but hands it to
    ``sys.excepthook``, which would print a traceback under the one line saying which helper died
    (:class:`HelperWatch`). That error from that code only is logged at debug level; everything
    else goes to the hook installed before. Also demotes asyncio's traceback for a libp2p stream
    cut before its header (:class:`_StreamCutBeforeItsHeader`)."""
    previous = sys.excepthook
    if getattr(previous, "_quiets_handshakes", False):
        return
    sharer = os.path.join("multiprocessing", "resource_sharer.py")

    def hook(exc_type, exc, tb) -> None:
        frames, in_sharer = tb, False
        while frames is not None:
            in_sharer = in_sharer or frames.tb_frame.f_code.co_filename.endswith(sharer)
            frames = frames.tb_next
        if in_sharer and issubclass(exc_type, (ConnectionError, EOFError)):
            logger.debug("a helper process left mid-handshake with the resource sharer: %r", exc)
            return
        previous(exc_type, exc, tb)

    hook._quiets_handshakes = True  # type: ignore[attr-defined]  # a marker on the function
    sys.excepthook = hook
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _StreamCutBeforeItsHeader) for f in asyncio_log.filters):
        asyncio_log.addFilter(_StreamCutBeforeItsHeader())


class _StreamCutBeforeItsHeader(logging.Filter):
    """p2pd opens a unix-socket connection to a stream handler of this process for each incoming
    libp2p stream; when the remote end resets it first (a peer that still dialed this peer's
    previous process, after a restart), p2pd closes it before the stream's header and hivemind's
    handler raises ``IncompleteReadError``, which asyncio logs at ERROR with a traceback. Nothing
    is lost (the remote retries or moves on): that record, and only that one, goes to debug.
    Helper processes forked afterwards inherit the filter."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (
            type(exc).__name__ == "IncompleteReadError"
            and str(record.msg).startswith("Unhandled exception in client_connected_cb")
        ):
            return True
        tb, frames = exc.__traceback__ if exc is not None else None, []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if not any("p2p_daemon_bindings" in f for f in frames):
            return True
        logger.debug("a libp2p stream was cut before its header reached this process: %r", exc)
        return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent's forking thread exits.

    Call it in the child right after the fork (also between fork and exec: it only calls prctl,
    getppid and kill). Covers the race where the parent died before the prctl: nobody would
    send the signal then, so this process sends it to itself. A no-op off Linux.

    Args:
        parent_pid: pid of the process that forked this one, read before the fork.
        sig: the signal to receive; SIGKILL for a process that ignores SIGTERM.
    """
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def _spawned_helper_setup(parent_pid: int) -> None:
    """preexec step of a subprocess of a helper (p2pd): runs in the child between fork and exec."""
    # A service manager's SIGTERM would stop it under the DHT process, which then waits on it
    # forever; its own session keeps the terminal's and the group's signals away. SIGTERM must
    # stay deliverable (the DHT process stops p2pd with it): the helper's SIG_IGN would survive exec.
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # kept across exec; Go honours an ignored SIGINT
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent_pid, signal.SIGTERM)  # p2pd exits cleanly on SIGTERM, removing its socket


def bind_subprocesses_to_this_process() -> None:
    """Make every subprocess that asyncio starts in this process die with it (p2pd in the DHT process).

    hivemind starts p2pd with ``asyncio.subprocess.create_subprocess_exec`` and no way to pass a
    preexec step, so the function is wrapped for this process only; call it in a helper process
    that starts nothing else. The wrapper runs in the thread that runs the event loop, which is
    the thread that forks: the parent-death signal then follows that thread's (the process's) end.
    """
    import asyncio.subprocess

    spawn = asyncio.subprocess.create_subprocess_exec
    if getattr(spawn, "_bound_to", None) == os.getpid():
        return

    @functools.wraps(spawn)
    def spawn_bound(*args, **kwargs):
        kwargs.setdefault("preexec_fn", functools.partial(_spawned_helper_setup, os.getpid()))
        return spawn(*args, **kwargs)

    spawn_bound._bound_to = os.getpid()  # type: ignore[attr-defined]  # a marker on the function
    asyncio.subprocess.create_subprocess_exec = asyncio.create_subprocess_exec = spawn_bound


def freeze_for_fork() -> None:
    """Call right before forking a helper process from a process that already holds much (hivemind's
    averager): after a collection, every Python object of this process moves to the garbage
    collector's permanent generation (``gc.freeze``) and stays there, so neither the child's
    collections nor this process's ever walk them again. A walk writes to each object's header, and
    on a page shared after the fork that write makes a private copy of the page (in the child, or in
    the parent, leaving the child the only holder of the old one). Objects frozen so are still freed
    by reference counting; only a reference cycle among them is never collected (Python's
    ``gc.freeze`` documentation: freeze right before ``fork``)."""
    gc.collect()
    gc.freeze()


BACKGROUND_NICE = 5
"""The niceness a peer training on an accelerator gives its sync work (:func:`yield_to_training`):
under Linux's scheduler a thread at nice 5 gets about a third of a core against one at 0, so a
training thread that wakes to feed the card (load the next batch, launch its kernels) is not left
waiting behind the averager's codecs, p2pd's streams or the background sync's copies; the sync
still gets every core the training thread leaves idle, which on such a host is most of them."""

_background_nice = 0
"""The niceness :func:`yield_to_training` sets (0: none); :func:`lower_background_priority` sets it."""


def lower_background_priority(nice: int = BACKGROUND_NICE) -> None:
    """From now on, the helper processes this process forks (the DHT process, with p2pd, and the
    averager) and the background threads that call :func:`yield_to_training` run at niceness
    ``nice``: call it before they start. For a peer whose inner step runs on an accelerator; a peer
    training on the CPU keeps its sync at the training's priority (its inner step takes every core,
    and a niced sync would miss its deadlines).

    Raises:
        ValueError: ``nice`` outside 0..19.
    """
    global _background_nice
    if not 0 <= nice <= 19:
        raise ValueError(f"nice = {nice}: give a niceness from 0 to 19")
    _background_nice = nice


def yield_to_training() -> None:
    """Lower the calling thread's CPU priority to the niceness :func:`lower_background_priority`
    set (Linux: niceness is per thread, and threads and processes it starts afterwards inherit it);
    a no-op when none was set, when the thread is already that nice, or where the OS refuses."""
    if _background_nice <= 0 or not hasattr(os, "nice"):
        return
    try:
        current = os.nice(0)
        if current < _background_nice:
            os.nice(_background_nice - current)
    except OSError:
        logger.debug("could not lower this thread's priority to nice %d", _background_nice)


class HelperProcess:
    """Mixin for a ``multiprocessing.Process`` subclass whose process serves its parent only
    (hivemind's DHT and averager): it dies with the parent and leaves signals to the parent.

    In the child, before the subclass's ``run``: the priority :func:`yield_to_training` gives (a peer
    training on an accelerator), SIGINT and SIGTERM are ignored (a terminal's or a
    service manager's signal to the whole group is the parent's to act on; the parent stops the
    helper through its shutdown), and SIGKILL arrives when the parent dies. The parent's Python
    signal handlers, inherited through the fork, are replaced, so they never run here.

    ``terminate()`` therefore kills: hivemind's shutdown falls back to it after its grace period,
    and multiprocessing's exit handler calls it before joining a daemonic child.
    """

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        parent = mp.parent_process()
        assert parent is not None and parent.pid is not None  # run() runs in the child
        die_with_parent(parent.pid, signal.SIGKILL)
        yield_to_training()  # with an accelerator: the training thread goes first (BACKGROUND_NICE)
        super().run()  # type: ignore[misc]  # the multiprocessing Process this is mixed into

    def terminate(self) -> None:
        self.kill()  # type: ignore[attr-defined]  # (likewise)


class StopOnSignal:
    """First SIGINT/SIGTERM sets ``event`` (the command finishes what it does and stops); a second
    one raises KeyboardInterrupt in the main thread (exit now).

    Args:
        event: set on the first signal; also tells afterwards whether a signal stopped the command.
        message: logged as a warning on the first signal.
    """

    def __init__(self, event: threading.Event, message: str = "stopping (signal again to exit now)"):
        self.event, self.message = event, message
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        logger.warning("%s", self.message)
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def exit_process(code: int) -> None:
    """End this process now with ``code``, once a command has released everything it holds: the
    exit handlers run (``atexit``: logging's flush, multiprocessing's reaping of helpers) and the
    standard streams are flushed, but the interpreter's teardown is skipped. Never returns.

    A peer's teardown garbage-collects everything the run built (model, optimizer, corpus, hivemind's
    futures): seconds to tens of seconds with nothing left to do, during which a person who pressed
    Ctrl-C sees "stopped" but no prompt. Call it only after every file was written and closed.

    Where the standard streams are not the process's own (an in-process runner such as click's
    ``CliRunner``, or pytest's capture), it raises ``SystemExit(code)`` instead: the process is not
    this command's alone.
    """
    import atexit

    if sys.stdout is not sys.__stdout__ or sys.stderr is not sys.__stderr__:
        raise SystemExit(code)

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass

    flush()
    try:
        atexit._run_exitfuncs()
    finally:
        flush()
        os._exit(code)


PEER_RESTART = "run the peer again: it resumes from its checkpoint"
"""What a peer whose helper died says to do (:class:`HelperDied`'s message ends with it)."""


def exited(process) -> bool:
    """Whether ``process`` (a ``multiprocessing.Process``) was started by this process and has
    exited; False in any other process (only the parent can tell), and for one never started."""
    return os.getpid() == getattr(process, "_parent_pid", None) and process.exitcode is not None


def helper_died(name: str, process, advice: str) -> HelperDied | None:
    """:class:`HelperDied` naming helper ``name`` (a ``multiprocessing.Process`` this process
    started) when it has :func:`exited`, else None.

    Args:
        name: whose and which, as the message says it: "peer's averager", "bootstrap node's DHT".
        advice: what to do, ending the message (e.g. "run the peer again: it resumes from its checkpoint").
    """
    if not exited(process):
        return None
    code = process.exitcode
    how = " (killed, most often for memory)" if code == -signal.SIGKILL else ""
    return HelperDied(f"this {name} process (pid {process.pid}) died with exit code {code}{how}; {advice}")


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, start time in clock ticks) of ``pid`` from /proc, or None (gone, or no /proc);
    the start time tells a live process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return text[text.index("(") + 1 : text.rindex(")")], fields[0], int(fields[19])


def children(pid: int) -> list[int]:
    """The pids of the processes ``pid`` started (from any of its threads), from /proc; [] when it
    is gone, or off Linux."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def child_named(pid: int, name: str) -> int | None:
    """The pid of a child of ``pid`` whose name is ``name``, e.g. the p2pd below a DHT process;
    None when there is none, or off Linux (no /proc)."""
    for child in children(pid):
        stat = proc_stat(child)
        if stat is not None and stat[0] == name:
            return child
    return None


class HelperWatch:
    """Watches a command's helper processes (DHT, p2pd, averager) from a daemon thread, once a second.

    When one has exited, :attr:`died` holds a :class:`HelperDied` naming it and ``stop`` is set, so
    the command stops as on a signal; it raises :attr:`died` once it has stopped (and a peer has
    written its checkpoint). :meth:`stop` before shutting the helpers down on purpose.

    Args:
        stop: the command's stop event (the one :class:`StopOnSignal` sets).
        advice: the end of the error message: what to do.
        period_s: seconds between two looks.
    """

    def __init__(self, stop: threading.Event, advice: str, period_s: float = 1.0):
        self.stop_event, self.advice, self.period_s = stop, advice, period_s
        self.died: HelperDied | None = None
        self._probes: list = []  # each returns a HelperDied for its helper once that one is gone, else None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="helper-watch", daemon=True)

    def watch(self, name: str, process) -> HelperWatch:
        """Add helper ``name`` (a started ``multiprocessing.Process`` of this process); before :meth:`start`."""
        self._probes.append(lambda: helper_died(name, process, self.advice))
        return self

    def watch_pid(self, name: str, pid: int | None) -> HelperWatch:
        """Add a process this one did not start itself (p2pd, below the DHT process) by its pid, as
        /proc shows it now; a None pid, or no /proc, adds nothing. Before :meth:`start`."""
        stat = None if pid is None else proc_stat(pid)
        if pid is not None and stat is not None:

            def probe() -> HelperDied | None:
                now = proc_stat(pid)
                if now is not None and now[2] == stat[2] and now[1] not in "ZX":
                    return None
                return HelperDied(f"this {name} process (pid {pid}) exited; {self.advice}")

            self._probes.append(probe)
        return self

    def watch_dht(self, owner: str, dht) -> HelperWatch:
        """Add a started hivemind DHT's process and the p2pd below it, named "<owner> DHT" and
        "<owner> p2pd" (``owner``: "peer's", "bootstrap node's"); before :meth:`start`."""
        return self.watch(f"{owner} DHT", dht).watch_pid(f"{owner} p2pd", child_named(dht.pid, "p2pd"))

    def start(self) -> HelperWatch:
        self._thread.start()
        return self

    def check(self) -> HelperDied | None:
        """Look once: the first helper found dead (also recorded in :attr:`died`, ``stop`` set), or None.

        A helper found dead once ``stop`` was set by something else (a signal: systemd's stop, and a
        Ctrl-C in a terminal, signal every process of the unit or the process group, the helpers
        with the command) is returned but not recorded: it went with the stop that was asked for, so
        the command exits as stopped (130), not as failed (75)."""
        asked_to_stop = self.stop_event.is_set()  # before this look: a signal, or an earlier death
        for probe in self._probes:  # in the order added: a DHT before the p2pd that dies with it
            died = probe()
            if died is not None:
                if self.died is None and not asked_to_stop:
                    self.died = died
                    logger.warning("stopping: %s", died)  # the command's exit line says it again
                self.stop_event.set()
                return died
        return None

    def raise_if_died(self) -> None:
        """Look once more (:meth:`check`) and raise the first helper death seen, if any: what a
        command does once it has stopped.

        Raises:
            HelperDied: a watched helper died.
        """
        self.check()
        if self.died is not None:
            raise self.died

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            if self.check() is not None:
                return

    def stop(self) -> None:
        """Stop watching (the helpers are about to be shut down on purpose). Idempotent."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
