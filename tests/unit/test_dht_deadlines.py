"""Calls into the DHT process never wait for good (peer/net/dht.py ``finish``, ``_visible_maddrs``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from peer.net import dht as swarm_dht
from protocol.errors import NetworkError


def test_a_call_that_never_answers_is_cancelled_and_raises_a_network_error():
    future = concurrent.futures.Future()  # what a lost task in the DHT process leaves behind
    with pytest.raises(NetworkError, match="did not finish reading things within 0.05 s"):
        swarm_dht.finish(future, "reading things", timeout_s=0.05)
    assert future.cancelled()
    done = concurrent.futures.Future()
    done.set_result(7)
    assert swarm_dht.finish(done, "x", timeout_s=0.05) == 7
    failed = concurrent.futures.Future()
    failed.set_exception(KeyError("k"))
    with pytest.raises(KeyError):  # what the call raised, unchanged
        swarm_dht.finish(failed, "x")


class SilentDaemon:
    """A DHT node whose p2pd never answers an identify; it still knows the addresses of the start."""

    async def get_visible_maddrs(self, latest=False):
        if latest:
            await asyncio.Future()  # never resolved
        return ["/ip4/10.0.0.1/tcp/1/p2p/A"]


def test_addresses_fall_back_to_the_last_known_when_p2pd_does_not_answer(monkeypatch):
    monkeypatch.setattr(swarm_dht, "DAEMON_CALL_TIMEOUT_S", 0.05)
    got = asyncio.run(swarm_dht._visible_maddrs(None, SilentDaemon(), latest=True))
    assert got == ["/ip4/10.0.0.1/tcp/1/p2p/A"]


def test_a_call_to_a_dht_whose_process_died_is_given_up_at_once_not_at_its_timeout():
    """The DHT is a real forked process (a sleeper standing in), killed as the OOM killer does."""
    dht = mp.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
    dht.start()
    try:
        future = concurrent.futures.Future()  # what the dead DHT process would have resolved
        threading.Timer(0.3, os.kill, args=(dht.pid, signal.SIGKILL)).start()
        with pytest.raises(NetworkError, match="the DHT process died before finishing a read of 'k'"):
            swarm_dht.finish(future, "a read of 'k'", timeout_s=3600.0, dht=dht)
        assert future.cancelled()
    finally:
        dht.kill()
        dht.join(30)
