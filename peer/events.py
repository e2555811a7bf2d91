"""The JSON event lines ``peer join`` and ``bootstrap run`` print with ``--log-format json``
(written by ``peer.reporting.Reporter``), read back by launchers and tests (peer/launch.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, eq=False)
class Event(Mapping[str, Any]):
    """One JSON object a child printed as one stdout line.

    Reads as the object itself (``event["round"]``, ``event.get("note")``); the accessors below
    type the fields every kind of event shares.
    """

    fields: Mapping[str, Any]
    """The object as printed, ``event`` key included (read-only)."""
    start: int = 1
    """Which start of the child printed it: 1 for the first, 2 after one restart (Child.start)."""

    @classmethod
    def parse(cls, line: bytes | str, start: int = 1) -> Event | None:
        """The event on ``line``, or None where the line is not a JSON object."""
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        return cls(MappingProxyType(obj), start) if isinstance(obj, dict) else None

    @property
    def kind(self) -> str:
        """``round``, ``sync``, ``eval``, ``started``, ``ready``, ``stopped``, ... ('' if absent)."""
        return str(self.fields.get("event", ""))

    @property
    def round(self) -> int | None:
        value = self.fields.get("round")
        return None if value is None else int(value)

    @property
    def time(self) -> float | None:
        """When the child emitted it: wall clock, seconds since the epoch (None if not stamped)."""
        value = self.fields.get("time")
        return None if value is None else float(value)

    @property
    def maddrs(self) -> tuple[str, ...]:
        """The multiaddrs of a ``started`` or ``ready`` event (empty for other kinds)."""
        return tuple(self.fields.get("maddrs") or ())

    def addresses_on(self, ip: str) -> list[str]:
        """The multiaddrs whose IPv4 address is ``ip``, in the order printed."""
        return [a for a in self.maddrs if f"/ip4/{ip}/" in a]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)
