"""One round told once: the round loop (engine.py) over a sync schedule (schedule.py: blocking.py,
overlapped.py, streamed.py), sharing one :class:`RoundState` (state.py) with catch-up (catchup.py),
checkpointing (checkpointing.py) and progress publishing (publishing.py)."""

from peer.round.checkpointing import checkpoint_due
from peer.round.engine import Trainer, make_schedule
from peer.round.state import RoundState

__all__ = ["RoundState", "Trainer", "checkpoint_due", "make_schedule"]
