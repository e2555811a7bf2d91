"""What each peer trains on, published for `peer status` and the monitor (issue #14 item 1).

The device is a per-peer fact, not part of the run manifest: CPU and GPU peers train in one
swarm. Each peer publishes one small record under :func:`devices_key` (subkey: its peer id),
signed by its identity key like its progress record (protocol/signing.py), so no one can describe
another peer's card; every node of ours refuses unsigned values there (peer/net/validator.py).
It is kept apart from the progress record, which is published every quarter round, because it
does not change while the peer runs.

Everything in a record came from the network: :meth:`DeviceRecord.from_wire` checks types and
bounds and strips control characters from the name before anyone prints it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from peer.net import dht as swarm_dht
from peer.net.dht import read_signed
from peer.net.periodic import Periodic
from protocol.errors import BadPayload
from protocol.keys import devices_key
from protocol.signing import PeerSigner
from protocol.text import sanitize

logger = logging.getLogger(__name__)

DEVICES_TTL_S = 600.0
"""How long a peer's device record lives in the DHT; :class:`DeviceAnnouncer` refreshes it every TTL/4."""

MAX_NAME_CHARS = 96
"""A device name longer than this is cut (the longest CUDA product names are under 50)."""

KINDS = ("cpu", "cuda", "mps")
PRECISIONS = ("fp32", "bf16", "fp16")
MAX_RANKS = 64
"""Devices one peer trains on at most (peer/train/ddp.py); a larger claim is a lie."""
MAX_MEMORY_GIB = 4096.0
"""No single accelerator has more memory than this (GiB); a larger claim is a lie."""


@dataclass(frozen=True, kw_only=True)
class DeviceRecord:
    """One peer's device, as its ``started`` event reports it (peer/train/device.py ``Placement``)."""

    kind: str
    """"cpu", "cuda" or "mps"."""
    name: str
    """The card's product name (``torch.cuda.get_device_name``) or the CPU's architecture."""
    memory_gib: float | None
    """The card's memory, GiB (None on CPU and MPS)."""
    capability: str | None
    """CUDA compute capability "major.minor" (None elsewhere)."""
    precision: str
    """What the inner loop computes in: "fp32", "bf16" or "fp16"."""
    ranks: int = 1
    """Devices the peer trains on data-parallel (peer/train/ddp.py)."""

    @classmethod
    def from_event(cls, fields: dict) -> DeviceRecord:
        """The record of a ``started`` event's device fields (``Placement.event_fields``)."""
        device = str(fields["device"])
        kind = next((k for k in KINDS if device.startswith(k)), "cpu")
        return cls(
            kind=kind,
            name=str(fields.get("device_name") or kind)[:MAX_NAME_CHARS],
            memory_gib=fields.get("device_memory_gib"),
            capability=fields.get("compute_capability"),
            precision=str(fields["precision"]),
            ranks=int(fields.get("ranks") or 1),
        )

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, value: Any) -> DeviceRecord:
        """Validate a record from the DHT.

        Raises:
            BadPayload: not a map of exactly the expected fields, a kind or precision outside
                :data:`KINDS`/:data:`PRECISIONS`, a memory that is not a finite number in
                (0, :data:`MAX_MEMORY_GIB`], a capability that is not "major.minor", ranks outside
                [1, :data:`MAX_RANKS`]. The name is sanitized and cut, never refused.
        """
        if not isinstance(value, dict):
            raise BadPayload(f"device record must be a map, got {type(value).__name__}")
        expected = {"kind", "name", "memory_gib", "capability", "precision", "ranks"}
        if set(value) != expected:
            raise BadPayload(f"device record has fields {sorted(map(str, value))[:8]}, expected {sorted(expected)}")
        kind, precision, memory, capability, ranks = (
            value["kind"],
            value["precision"],
            value["memory_gib"],
            value["capability"],
            value["ranks"],
        )
        if kind not in KINDS:
            raise BadPayload(f"device record kind {sanitize(repr(kind), max_chars=40)}: expected one of {KINDS}")
        if precision not in PRECISIONS:
            raise BadPayload(
                f"device record precision {sanitize(repr(precision), max_chars=40)}: expected one of {PRECISIONS}"
            )
        if memory is not None and (
            not isinstance(memory, (int, float))
            or isinstance(memory, bool)
            or not math.isfinite(memory)
            or not 0 < memory <= MAX_MEMORY_GIB
        ):
            raise BadPayload(
                f"device record memory_gib = {sanitize(repr(memory), max_chars=40)}: "
                f"expected a number in (0, {MAX_MEMORY_GIB:.0f}] or null"
            )
        if capability is not None and not (
            isinstance(capability, str) and len(capability) <= 7 and _is_capability(capability)
        ):
            raise BadPayload(
                f'device record capability {sanitize(repr(capability), max_chars=40)}: expected "major.minor" or null'
            )
        if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= MAX_RANKS:
            raise BadPayload(
                f"device record ranks = {sanitize(repr(ranks), max_chars=40)}: expected an integer in [1, {MAX_RANKS}]"
            )
        name = value["name"]
        if not isinstance(name, str):
            raise BadPayload(f"device record name must be a string, got {type(name).__name__}")
        return cls(
            kind=kind,
            name=sanitize(name, max_chars=MAX_NAME_CHARS),
            memory_gib=memory,
            capability=capability,
            precision=precision,
            ranks=ranks,
        )

    def describe(self) -> str:
        """One short line for tables: ``cuda NVIDIA GeForce RTX 3060 11.8 GiB sm 8.6 bf16``, ``2×``
        in front when the peer trains on several devices."""
        parts = [
            self.kind,
            self.name if self.name != self.kind else None,
            None if self.memory_gib is None else f"{self.memory_gib:.1f} GiB",
            None if self.capability is None else f"sm {self.capability}",
            self.precision,
        ]
        text = " ".join(p for p in parts if p)
        return f"{self.ranks}× {text}" if self.ranks > 1 else text


def _is_capability(text: str) -> bool:
    major, dot, minor = text.partition(".")
    return bool(dot) and major.isdigit() and minor.isdigit() and major.isascii() and minor.isascii()


def publish_device(dht, run_id: str, signer: PeerSigner, record: DeviceRecord, ttl_s: float = DEVICES_TTL_S) -> bool:
    """Store this peer's device record for ``run_id``, signed by ``signer`` under its peer id.
    Returns whether a node accepted it."""
    from hivemind.utils import get_dht_time

    key, expiration = devices_key(run_id), get_dht_time() + ttl_s
    return swarm_dht.store(dht, key, signer.seal(key, expiration, record.to_wire()), expiration, subkey=signer.peer_id)


def read_devices(dht, run_id: str, *, prefer: Collection[str] = ()) -> dict[str, DeviceRecord]:
    """Every peer's published device (validated): peer id → record.

    A record whose signature does not match its subkey is ignored and counted
    (``signing.REJECTED["devices"]``); a malformed one, or one expiring further ahead than a peer
    publishes, is skipped with a debug log.

    At most ``MAX_RECORDS_READ`` entries are verified and kept (peer/net/dht.py ``select_entries``:
    ``prefer`` first, then a per-process keyed hash of the peer id): a flood of records signed by
    fresh identities costs a bounded number of signature checks.

    Raises:
        NetworkError: the DHT did not answer in time (peer/net/dht.py ``read_value``).
    """
    found = read_signed(
        dht,
        devices_key(run_id),
        "devices",
        lambda _, data: DeviceRecord.from_wire(data),
        max_ahead_s=DEVICES_TTL_S + 600,
        prefer=prefer,
    )
    return {peer_id: record for peer_id, record, _ in found}


class DeviceAnnouncer(Periodic):
    """Keeps this peer's device record alive (stored again every TTL/4) until :meth:`stop`."""

    def __init__(self, dht, run_id: str, signer: PeerSigner, record: DeviceRecord, ttl_s: float = DEVICES_TTL_S):
        super().__init__(period_s=ttl_s / 4, name="device-announcer")
        self.dht, self.run_id, self.signer, self.record, self.ttl_s = dht, run_id, signer, record, ttl_s

    def tick(self) -> None:
        if not publish_device(self.dht, self.run_id, self.signer, self.record, self.ttl_s):
            logger.debug("no DHT node accepted this peer's device record; retrying")
