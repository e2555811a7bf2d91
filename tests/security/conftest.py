"""Shared by the security tests."""

from __future__ import annotations

import asyncio
import warnings

import pytest


@pytest.fixture(scope="module", autouse=True)
def close_the_main_threads_event_loop():
    """After each module: close the event loop hivemind made for this thread.

    hivemind's ``MPFuture`` (every ``DHT.get``/``store``/``run_coroutine`` called here) calls
    ``asyncio.get_event_loop()``, which makes a loop the first time and never closes it; a test that
    later runs ``asyncio.run`` drops it, and the garbage collector then reports an unclosed loop
    (its self-pipe sockets) at the end of the session, which warnings-as-errors turns into a failure.
    """
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            loop = asyncio.get_event_loop()
        except RuntimeError:
            return
    if not loop.is_running():
        loop.close()
    asyncio.set_event_loop(None)


@pytest.fixture(autouse=True)
def empty_log_once_memory():
    """Each test starts with an empty log-once memory in protocol/signing.py's ``REJECTED``: a
    flood test (test_record_flood.py) fills it to its bound, after which no new writer is logged,
    and a later test that expects its rejection to be logged once would see nothing."""
    from protocol.signing import REJECTED

    saved = set(REJECTED._logged)
    REJECTED._logged.clear()
    yield
    REJECTED._logged.clear()
    REJECTED._logged.update(saved)
