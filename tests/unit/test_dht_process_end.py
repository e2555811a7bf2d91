"""peer/net/dht_node.py: a DHT process whose requester died mid-request ends with one line.

hivemind's DHT process fetches each request's reply pipe from the sender's process; when the
sender (the averager, killed by the OOM killer) is gone before that, the fetch raises EOFError and
hivemind's request loop ends with a traceback on the peer's stderr (seen once in CI's
test_process_lifetime, the averager killed during a delayed sync). The peer stops for the helper's
death anyway; the DHT process now says why in one line and exits 1. The DHT process's setup and
hivemind's loop are replaced here: this tests only what ``SwarmDHT.run`` makes of the loop's end.
"""

from __future__ import annotations

import logging

import pytest

import peer.net.dht_node as dht_node
from peer.net.lifetime import HelperProcess


def unstarted():
    """A ``SwarmDHT`` never started (no ``__init__``, no process), whose ``run`` the test calls."""
    swarm_dht = dht_node._helper_dht_class()

    class Unstarted(swarm_dht):
        def __del__(self) -> None:  # hivemind's would look for the process it never started
            pass

    return swarm_dht, Unstarted.__new__(Unstarted)


@pytest.mark.parametrize("error", [EOFError(), ConnectionResetError(104, "reset")])
def test_a_requester_that_died_ends_the_dht_process_with_one_line(monkeypatch, caplog, error):
    for name in ("bind_subprocesses_to_this_process", "_decode_found_values_one_by_one"):
        monkeypatch.setattr(dht_node, name, lambda: None)
    monkeypatch.setattr(dht_node.dht_storage, "install", lambda: None)

    def loop_ends(self):
        raise error

    monkeypatch.setattr(HelperProcess, "run", loop_ends)
    swarm_dht, dht = unstarted()
    with caplog.at_level(logging.WARNING, logger="peer.net.dht_node"), pytest.raises(SystemExit) as ended:
        swarm_dht.run(dht)
    assert ended.value.code == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"DHT process stops: a request's sender died before its reply pipe arrived ({error!r})"
    ]


def test_any_other_error_still_raises(monkeypatch):
    for name in ("bind_subprocesses_to_this_process", "_decode_found_values_one_by_one"):
        monkeypatch.setattr(dht_node, name, lambda: None)
    monkeypatch.setattr(dht_node.dht_storage, "install", lambda: None)

    def loop_fails(self):
        raise ValueError("a bug")

    monkeypatch.setattr(HelperProcess, "run", loop_fails)
    swarm_dht, dht = unstarted()
    with pytest.raises(ValueError, match="a bug"):
        swarm_dht.run(dht)
