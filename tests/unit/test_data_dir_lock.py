"""peer/state/data_dir.py: one peer per data directory, with real flock locks and a real fork."""

from __future__ import annotations

import os
import signal
import time

import pytest

from peer.state.data_dir import LOCK_FILE, hold_data_dir
from protocol.errors import ConfigError


def test_a_second_peer_on_the_directory_is_refused_naming_it_and_the_holder(tmp_path):
    d = tmp_path / "peer"
    with hold_data_dir(d) as lock:
        assert lock == d / LOCK_FILE and lock.read_text().strip() == str(os.getpid())
        with pytest.raises(ConfigError, match=rf"data dir {d} is in use by another peer \(pid {os.getpid()}\)") as err:
            with hold_data_dir(d):
                pass
        assert err.value.exit_code == 78 and "--data-dir" in str(err.value)
    with hold_data_dir(d):  # released when the first block ended
        pass
    with hold_data_dir(tmp_path / "other"):  # another directory is another peer's
        pass


def test_forked_children_do_not_keep_the_lock(tmp_path):
    """The DHT and averager processes are forked from the peer: when the peer is gone, its
    directory is free even while a child still lives."""
    d = tmp_path / "peer"
    ready_r, ready_w = os.pipe()
    with hold_data_dir(d):
        child = os.fork()
        if child == 0:  # the child: its fork handlers have run; outlive the parent's hold
            os.write(ready_w, b"x")
            time.sleep(30)
            os._exit(0)
        assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    os.close(ready_w)
    try:
        with hold_data_dir(d):  # the child is still alive here
            assert os.waitpid(child, os.WNOHANG) == (0, 0)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_directory_that_cannot_be_made_is_one_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=rf"data dir {blocker / 'peer'}: cannot use it .*writable --data-dir"):
        with hold_data_dir(blocker / "peer"):
            pass
