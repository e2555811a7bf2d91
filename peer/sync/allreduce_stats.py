"""What one group all-reduce did, from one peer's side (:class:`AllreduceStats`): the counters
peer/sync/allreduce.py ``GroupAllreduce`` fills and the averager hands back to the host process
(pickled through hivemind's pipe: plain fields only)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AllreduceStats:
    bytes_sent: int = 0
    """Frame bytes this peer wrote to its streams (headers included; libp2p framing excluded)."""
    bytes_received: int = 0
    """Frame bytes this peer read from its streams."""
    send_seconds: float = 0.0
    """Wall time from the first byte sent to the last piece written."""
    excluded: dict[int, str] = field(default_factory=dict)
    """Senders this peer (as an owner) excluded, with the reason."""
    partial_pieces: int = 0
    """Pieces whose mean left out at least one sender."""
    capped_weights: dict[int, float] = field(default_factory=dict)
    """Senders whose claimed token weight this owner cut to the cap, with the weight they claimed."""
    clipped: dict[int, int] = field(default_factory=dict)
    """Senders whose contribution this owner struck (over STRIKE_MEDIAN_FACTOR × the median norm,
    clipped), with how many pieces."""
    dropped: set[int] = field(default_factory=set)
    """Senders this owner excluded for an invalid contribution (non-finite, malformed), not for silence."""
    refused: dict[str, str] = field(default_factory=dict)
    """Owners (peer ids) whose mean of some piece this peer refused as a receiver (``owner_mean_problem``), with
    the first reason; those pieces were applied as zeros (Δ) or this peer's own values (φ)."""
    refused_pieces: int = 0
    """Pieces whose owner's mean this peer refused."""
    struck_owners: set[str] = field(default_factory=set)
    """Owners in ``refused`` with a refusal that counts a strike (``MeanRefusal.strike``: the norm or
    φ checks; not the share check, which honest owners can fail under attack)."""
    skipped_owners: set[str] = field(default_factory=set)
    """Owners (peer ids) whose means differed between receivers (the receipts): their pieces applied
    as refused (zeros for Δ, own values for φ) this round."""
    equivocators: set[str] = field(default_factory=set)
    """Owners in ``skipped_owners`` proven, by their own two seals, to have sent different means to
    different receivers (peer/sync/receipts.py)."""
    kept_rows: list[tuple[int, int, int]] = field(default_factory=list)
    """Without the carry (``SyncRequest.carry_skipped`` False): the rows (tensor, first row, stop row)
    of this peer's Δ pieces applied as zeros because the receipts skipped their owner."""
    receipt_liars: set[str] = field(default_factory=set)
    """Groupmates whose receipt reported a digest of some owner's means that the owner never sealed."""
    unread_receipts: int = 0
    """Owner: groupmates whose receipt this peer did not read (none came in time, or it is not read):
    the verdict of groupmates that read it may differ, so which of them hold this peer's state after
    the round is not known. 0 for a peer that owns no piece (it reads no receipt)."""
    seconds: float = 0.0
    """Wall time of the whole exchange, from this peer's start to its last mean."""
    started_at: float = 0.0
    """time.time() when this peer started the exchange."""
