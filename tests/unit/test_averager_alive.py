"""peer.sync.averager: the host never waits forever on a dead averager process.

A LocoAverager shell stands on a real forked process (a sleeper, killed with SIGKILL as the
kernel's OOM killer does) instead of hivemind's averager: each wait the host makes on that process
(a call's future, the shared buffers' lock, its shutdown) ends in HelperDied once it is gone.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from peer.sync.averager import LocoAverager
from protocol.errors import HelperDied


@pytest.fixture
def shell():
    """A LocoAverager shell whose process is a live sleeper; ``kill`` ends it with SIGKILL."""
    process = mp.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
    process.start()
    peer = object.__new__(LocoAverager)
    peer._parent_pid, peer._popen, peer._closed = os.getpid(), process._popen, False
    peer.lock_averaged_tensors = mp.get_context("fork").Lock()
    peer._averaged_tensors = ["buffer"]
    peer._inner_pipe, peer._outer_pipe = mp.Pipe(duplex=True)

    def kill() -> None:
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)

    peer.kill = kill
    try:
        yield peer
    finally:
        if process.is_alive():
            kill()
        peer._parent_pid = None  # hivemind's __del__ leaves a shell alone


def test_check_alive_passes_while_the_process_runs_and_names_it_once_killed(shell):
    shell.check_alive()
    shell.kill()
    with pytest.raises(
        HelperDied, match=rf"peer's averager process \(pid {shell._popen.pid}\) died with exit code -9 \(killed"
    ) as info:
        shell.check_alive()
    assert "run the peer again" in str(info.value) and info.value.exit_code == 75


def test_a_call_answered_returns_its_result(shell):
    future = concurrent.futures.Future()
    threading.Timer(0.2, future.set_result, args=("bits set",)).start()
    assert shell._await(future) == "bits set"


def test_a_call_never_answered_by_a_killed_process_raises_averager_died(shell):
    future = concurrent.futures.Future()  # what the dead process would have resolved
    threading.Timer(0.3, shell.kill).start()
    with pytest.raises(HelperDied):
        shell._await(future)  # no timeout: only the process's death ends the wait


def test_a_bounded_call_to_a_live_process_times_out(shell):
    with pytest.raises(TimeoutError):
        shell._await(concurrent.futures.Future(), timeout=0.2)


def test_the_buffers_lock_held_by_a_process_that_died_raises_averager_died(shell):
    with shell.get_tensors() as buffers:
        assert buffers == ["buffer"]
    shell.lock_averaged_tensors.acquire()  # as the averager process holds it while it writes the means
    shell.kill()
    with pytest.raises(HelperDied):
        with shell.get_tensors():
            pass


def test_shutdown_of_a_dead_averager_stops_only_the_host_side(shell):
    shell.kill()
    shell.shutdown()  # hivemind's would log an error with a traceback
    assert shell._outer_pipe.recv() == ("_SHUTDOWN", None)
