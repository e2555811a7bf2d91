"""One round told once: the round loop over a sync schedule, sharing one :class:`RoundState`.

blocking.py: the blocking schedule: the whole model synced at the round's end (DiLoCo)
catchup.py: catch-up: adopting the swarm's state when behind or diverged; a joiner's first adoption
checkpointing.py: this peer's checkpoint: written at round ends and on a stop, restored at start
engine.py: the round loop: inner phase, sync, round's end, catch-up
loss_gate.py: NoLoCo's loss gate: a group's step applied only if no worse on the next batches than a step alone
overlapped.py: the overlapped schedules ``delayed`` and ``eager``: a sync runs while the next round trains
publishing.py: this peer's progress records in the DHT and its evaluations of φ
records.py: reads of the swarm's progress records, asked for in the background
schedule.py: the sync-schedule interface: when each part of the model is sent and its mean lands
state.py: :class:`RoundState`: φ, θ, outer state, served snapshots, position, and their lock
streamed.py: the fragment schedule (Streaming DiLoCo): fragments synced at staggered offsets
syncing.py: one sync with the group, as every schedule makes it
timing.py: :class:`Timing`: when a round's sync runs and where its mean lands, ``sync.overlap`` read once
"""

from peer.round.checkpointing import checkpoint_due
from peer.round.engine import Trainer, make_schedule
from peer.round.state import RoundState
from peer.round.timing import Timing

__all__ = ["RoundState", "Timing", "Trainer", "checkpoint_due", "make_schedule"]
