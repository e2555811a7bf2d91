"""peer.sync.averager: a leaving peer lets its groupmates finish reading the means it owes them.

LocoAverager's shutdown coroutine is run on its own (no averager process, no network): the
groupmates' open all-reduce streams are its stream slots, and hivemind's own shutdown is replaced
by a recorder, so the tests see what was still open when the handlers were about to be removed.
"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.averaging import DecentralizedAverager

from peer.net.limits import StreamSlots
from peer.sync import averager as averager_module
from peer.sync.averager import LocoAverager


def _leaving_peer(monkeypatch, open_streams: int) -> tuple[LocoAverager, list[int]]:
    """A LocoAverager shell with ``open_streams`` groupmates' streams open; the list records the
    streams still open each time hivemind's shutdown began."""
    seen: list[int] = []
    peer = object.__new__(LocoAverager)
    peer._parent_pid = None  # not a started averager: hivemind's __del__ leaves it alone
    peer._allreduce_slots = StreamSlots(per_peer=4, total=16)
    for i in range(open_streams):
        assert peer._allreduce_slots.acquire(f"groupmate-{i}")

    async def hivemind_shutdown(self, timeout):
        seen.append(0 if self._allreduce_slots is None else self._allreduce_slots.open)

    monkeypatch.setattr(DecentralizedAverager, "_shutdown", hivemind_shutdown)
    return peer, seen


def test_shutdown_waits_for_groupmates_still_reading_means(monkeypatch):
    peer, seen = _leaving_peer(monkeypatch, open_streams=2)

    async def leave():
        loop = asyncio.get_running_loop()
        # the groupmates close their streams once they have read every mean
        loop.call_later(0.1, peer._allreduce_slots.release, "groupmate-0")
        loop.call_later(0.2, peer._allreduce_slots.release, "groupmate-1")
        await peer._shutdown(5.0)

    asyncio.run(leave())
    assert seen == [0]


def test_shutdown_goes_on_when_a_groupmate_never_closes(monkeypatch, caplog):
    monkeypatch.setattr(averager_module, "SHUTDOWN_DRAIN_S", 0.05)
    peer, seen = _leaving_peer(monkeypatch, open_streams=1)
    with caplog.at_level("INFO", logger="peer.sync.averager"):
        asyncio.run(peer._shutdown(5.0))
    assert seen == [1]  # cut as before, after the grace
    assert "1 all-reduce stream(s) of groupmates still open" in caplog.text


@pytest.mark.parametrize("slots", [None, "empty"])
def test_shutdown_without_open_streams_does_not_wait(monkeypatch, slots):
    peer, seen = _leaving_peer(monkeypatch, open_streams=0)
    if slots is None:
        peer._allreduce_slots = None  # no groupmate ever opened a stream
    monkeypatch.setattr(averager_module, "SHUTDOWN_DRAIN_S", 60.0)
    asyncio.run(asyncio.wait_for(peer._shutdown(None), 10.0))  # would wait 60 s if it waited
    assert len(seen) == 1
