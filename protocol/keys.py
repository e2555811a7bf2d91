"""DHT key names. Keys and averager prefixes must not contain '.' (hivemind's group key syntax)."""

from __future__ import annotations

RUNS_KEY = "locoswarm_runs"
"""Subkey: run id; value: the run's manifest signed by its owner (``{"m": canonical msgpack bytes,
"s": Ed25519 signature}``, protocol/manifest.py ``SignedManifest``). Lets `peer join` find and
verify the run; every node of ours refuses other values here (peer/net/validator.py)."""

HOME_KEY = "locoswarm_home"
"""Subkey: a bootstrap node's peer id; value: ``{"run_id": ...}``, the run it announces as its own,
signed by that node's identity (peer/net/home_run.py). Protected like a run's records."""


def progress_key(run_id: str) -> str:
    """Subkey: peer id (base58); value: a progress record (see protocol.records) signed by that peer
    (protocol/signing.py ``PeerSigner.seal``)."""
    return f"locoswarm_progress_{run_id}"


def addresses_key(run_id: str) -> str:
    """Subkey: peer id (base58); value: that peer's visible multiaddrs (list of str), signed by it
    (peer/net/addresses.py)."""
    return f"locoswarm_peers_{run_id}"


def devices_key(run_id: str) -> str:
    """Subkey: peer id (base58); value: that peer's device record, signed by it (peer/net/devices.py)."""
    return f"locoswarm_devices_{run_id}"


def averager_prefix(run_id: str, algorithm: str) -> str:
    """Prefix of the averager's matchmaking keys; the round number goes into the group bits."""
    return f"locoswarm_{algorithm}_{run_id}"


ROUND_BITS = 20
"""Group bits that carry the round number (mod 2**20), so only peers at the same round match."""


GROUP_INDEX_BITS = 12
"""With random groups (NoLoCo), further group bits carry the group's index within the round."""


RETRY_BITS = 2
"""Bits of the retry number of a round's sync (different from GROUP_INDEX_BITS, so no key collides)."""


def sync_index(round_: int, fragment: int | None = None, fragments: int = 1) -> int:
    """What a sync's group bits carry as its "round": the round itself, or with Streaming DiLoCo's
    fragments (``sync.overlap = "streaming"``) ``round_ · fragments + fragment``, so the fragment
    syncs of one round meet under keys of their own and the matchmaking-key protection around a
    round (peer/net/validator.py) covers them as it covers rounds.

    Raises:
        ValueError: ``fragment`` outside [0, fragments).
    """
    if fragment is None:
        return round_
    if not 0 <= fragment < fragments:
        raise ValueError(f"fragment = {fragment}: need 0 <= fragment < fragments = {fragments}")
    return round_ * fragments + fragment


def round_group_bits(round_: int, group_index: int | None = None, attempt: int = 0) -> str:
    """Averager group bits: the round (mod 2**20), then the random group's index if any, then the
    retry number when this is a retry of the round's sync (peers that retry meet only each other)."""
    bits = format(round_ % (1 << ROUND_BITS), f"0{ROUND_BITS}b")
    if group_index is not None:
        bits += format(group_index % (1 << GROUP_INDEX_BITS), f"0{GROUP_INDEX_BITS}b")
    if attempt:
        bits += format(attempt % (1 << RETRY_BITS), f"0{RETRY_BITS}b")
    return bits
