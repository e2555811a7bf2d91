"""Progress records that peers publish to the DHT, and their validation on receipt."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from protocol.errors import BadPayload
from protocol.text import sanitize
from protocol.version import PROTOCOL_VERSION

MAX_ROUND = 2**31 - 1
"""No run reaches this many rounds; a record claiming more (2^63, say) is not believed. Rounds fit
every int32/int64 they are written into (seeds, tensors, state meta)."""
MAX_INNER_STEP = MAX_ROUND * 10**6
"""Rounds × the largest H a manifest allows (sync.inner_steps ≤ 10^6)."""
MAX_GROUP_SIZE = 4096
"""The manifest's bound on sync.target_group_size."""
MAX_PEER_ID_CHARS = 128
"""A libp2p peer id in base58 is 46-53 characters; a longer string is not one."""
MAX_COUNT = 2**53
"""Byte counters: any larger value is a lie (and would lose precision as a float)."""
CAPS_FIELDS = {
    "upload_cap_mbit": 1e6,
    "upload_mbit": 1e6,
    "day_gb": 1e9,
    "day_cap_gb": 1e6,
    "rounds_sat_out": float(MAX_ROUND),
    "stronger_syncs": float(MAX_ROUND),
}
"""A record's ``caps``: field → largest believable value; each is a finite number ≥ 0 or null."""
_UPPER = {
    "round": MAX_ROUND,
    "inner_step": MAX_INNER_STEP,
    "group_size": MAX_GROUP_SIZE,
    "bytes_sent": MAX_COUNT,
    "bytes_received": MAX_COUNT,
}


@dataclass(frozen=True, kw_only=True)
class ProgressRecord:
    """What one peer says about itself after each round (stored under ``progress_key``)."""

    round: int
    """Outer step t the peer is now at (rounds completed, including adopted ones)."""
    inner_step: int
    """Cumulative inner steps of φ's history: round·H plus steps done this round."""
    train_loss: float
    tokens_per_s: float
    group_size: int
    bytes_sent: int
    """Sync bytes this peer wrote to the network in its last round (counted at the transport)."""
    bytes_received: int = 0
    """Sync bytes this peer read from the network in its last round."""
    eval_loss: float | None = None
    state_digest: str = ""
    """Hex digest (32 characters) of the state this peer holds at the start of ``round``: φ, outer
    optimizer state and position (peer/state/snapshot.py). Peers that completed a round together hold
    the same digest; joiners download the state with a digest from the peers that publish it.
    Empty before the peer has a state to serve."""
    groupmates: tuple[str, ...] = ()
    """Peer ids that completed this peer's last sync with it, in full (every piece averaged with
    each of them: bytes exchanged both ways), as this peer's signed statement; empty after a sync
    alone, a failed or partial one, or an adopted state. Mutual statements (a round apart at most)
    are what a joiner counts as peers that did the work (peer/state/vouching.py)."""
    version: int = PROTOCOL_VERSION
    caps: dict[str, float] | None = None
    """A peer with its own caps (``peer join --max-upload-mbit``/``--max-gb-per-day``): its use against
    them, keys of :data:`CAPS_FIELDS` (Mbit/s, GB, rounds); None, and absent from the wire, without caps."""

    @property
    def claimed_loss(self) -> float | None:
        """The loss (nats/token) this record claims for its state: ``eval_loss`` (φ of ``round`` on
        the run's validation windows) when it has one, else ``train_loss`` (its last round's, or
        mid-round, training loss); None when neither is above 0 (a peer that has not finished a round
        publishes 0.0). A claim, not a measurement: a joiner holds a state it downloads against the
        best claim (peer/round/catchup.py ``CLAIM_MARGIN``) and believes a claim only while the
        state of its class bears it out."""
        for loss in (self.eval_loss, self.train_loss):
            if loss is not None and loss > 0:
                return float(loss)
        return None

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire["groupmates"] = list(self.groupmates)  # msgpack has no tuple: the signed body holds a list
        if self.caps is None:
            del wire["caps"]  # the record of a peer without caps is what it was before caps existed
        return wire

    @classmethod
    def from_wire(cls, value: Any) -> ProgressRecord:
        """Validate a record from the DHT.

        Raises:
            BadPayload: not a dict of the expected fields with finite numbers and integers in
                ``[0, bound]`` (``round`` ≤ :data:`MAX_ROUND`, ...), a 32-character hex digest and
                at most :data:`MAX_GROUP_SIZE` alphanumeric ASCII groupmate ids.
        """
        if not isinstance(value, dict):
            raise BadPayload(f"progress record must be a map, got {type(value).__name__}")
        expected = {
            "round",
            "inner_step",
            "train_loss",
            "tokens_per_s",
            "group_size",
            "bytes_sent",
            "bytes_received",
            "eval_loss",
            "state_digest",
            "groupmates",
            "version",
        }
        if set(value) - {"caps"} != expected:
            # keys may be anything msgpack carries (bytes among them): name them as text
            raise BadPayload(f"progress record has fields {sorted(map(repr, value))[:16]}, expected {sorted(expected)}")
        caps = _caps_from_wire(value.get("caps"))
        if value["version"] != PROTOCOL_VERSION:
            raise BadPayload(f"progress record version {value['version']!r}, expected {PROTOCOL_VERSION}")
        for name, upper in _UPPER.items():
            v = value[name]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= upper:
                raise BadPayload(f"progress record field {name} = {v!r}: expected an integer in [0, {upper}]")
        for name in ("train_loss", "tokens_per_s", "eval_loss"):
            v = value[name]
            if v is None and name == "eval_loss":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise BadPayload(f"progress record field {name} = {v!r}: expected a finite number")
        digest = value["state_digest"]
        if (
            not isinstance(digest, str)
            or len(digest) not in (0, 32)
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise BadPayload(f"progress record field state_digest = {digest!r}: expected 32 lowercase hex characters")
        mates = value["groupmates"]
        if not isinstance(mates, (list, tuple)) or len(mates) > MAX_GROUP_SIZE:
            raise BadPayload(
                f"progress record field groupmates is a {type(mates).__name__} of "
                f"{len(mates) if isinstance(mates, (list, tuple)) else '?'} entries: expected a list "
                f"of at most {MAX_GROUP_SIZE} peer ids"
            )
        for mate in mates:
            if (
                not isinstance(mate, str)
                or not 0 < len(mate) <= MAX_PEER_ID_CHARS
                or not mate.isalnum()
                or not mate.isascii()
            ):
                raise BadPayload(f"progress record field groupmates holds {mate!r:.80}: expected a base58 peer id")
        return cls(**{**value, "groupmates": tuple(mates), "caps": caps})


def _caps_from_wire(caps: Any) -> dict[str, float] | None:
    """A record's ``caps`` checked: absent/None, or a map of :data:`CAPS_FIELDS` (each a finite number in
    [0, bound] or null; nulls dropped). Raises BadPayload otherwise."""
    if caps is None:
        return None
    if not isinstance(caps, dict) or not set(caps) <= set(CAPS_FIELDS):
        raise BadPayload(
            f"progress record field caps = {sanitize(repr(caps), max_chars=120)}: expected a map of {sorted(CAPS_FIELDS)}"
        )
    checked = {}
    for name, v in caps.items():
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= CAPS_FIELDS[name]:
            raise BadPayload(
                f"progress record field caps.{name} = {sanitize(repr(v), max_chars=40)}: "
                f"expected a number in [0, {CAPS_FIELDS[name]:g}]"
            )
        checked[name] = float(v)
    return checked
