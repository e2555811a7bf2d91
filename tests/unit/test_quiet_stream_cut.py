"""A libp2p stream cut before its header (a peer that still dialed this peer's previous process,
after a restart) is not an ERROR traceback on the peer's stderr (issue #53 item 4, "no spurious
warning" on restart): peer/net/lifetime.py demotes that asyncio record, and only that one."""

from __future__ import annotations

import asyncio
import logging

import pytest

from peer.net.lifetime import quiet_handshakes_cut_by_a_dead_helper


def cut_stream_error() -> BaseException:
    """The error hivemind's stream handler raises when p2pd closes the connection before the header."""
    from hivemind.p2p.p2p_daemon_bindings.utils import read_unsigned_varint

    async def read() -> None:
        reader = asyncio.StreamReader()
        reader.feed_eof()
        await read_unsigned_varint(reader)

    with pytest.raises(asyncio.IncompleteReadError) as exc:
        asyncio.run(read())
    return exc.value


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_only_the_cut_stream_traceback_is_demoted(monkeypatch):
    import sys

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the function also wraps the hook
    log = logging.getLogger("asyncio")
    monkeypatch.setattr(log, "filters", list(log.filters))
    kept = Kept()
    log.addHandler(kept)
    try:
        quiet_handshakes_cut_by_a_dead_helper()
        quiet_handshakes_cut_by_a_dead_helper()  # idempotent: one filter
        assert len(log.filters) == 1
        cut = cut_stream_error()
        log.error(
            "Unhandled exception in client_connected_cb\ntransport: x", exc_info=(type(cut), cut, cut.__traceback__)
        )
        assert kept.records == []
        other = asyncio.IncompleteReadError(b"", 1)  # raised elsewhere: still an error
        try:
            raise other
        except asyncio.IncompleteReadError as exc:
            log.error("Unhandled exception in client_connected_cb", exc_info=(type(exc), exc, exc.__traceback__))
        log.error("Task exception was never retrieved", exc_info=(type(cut), cut, cut.__traceback__))
        assert [r.getMessage()[:34] for r in kept.records] == [
            "Unhandled exception in client_conn",
            "Task exception was never retrieved",
        ]
    finally:
        log.removeHandler(kept)
