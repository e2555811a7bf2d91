"""hivemind's DecentralizedAverager, adapted for DiLoCo rounds.

Runs in its own process (hivemind forks it). What it adds to the stock averager:

* matchmaking is keyed by run id (the prefix) and round (the group bits), so only peers at the
  same outer step form a group;
* a partly averaged result is detected and rejected: hivemind 1.1.12 reports success when a
  groupmate died mid all-reduce and silently leaves its parts un-averaged (DESIGN.md, known
  traps). We collect the whole result first and apply it only if every part arrived from every
  groupmate;
* the bytes this peer sent in the all-reduce are counted per round;
* joiners download φ, the outer momentum and the round through ``get_current_state``.

The class name is part of the wire protocol: hivemind derives RPC handler names from it.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import threading
from typing import Any, Callable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

logger = logging.getLogger(__name__)

StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class PartialAverage(AllreduceException):
    """Some parts of the tensors were not averaged over the whole group."""


class LocoAverager(DecentralizedAverager):
    """Averages pseudo-gradients within a group of peers at the same round.

    Args:
        averaged_tensors: fp32 buffers shaped like the model parameters; hivemind moves them to
            shared memory. The trainer writes Δ into them before a step and reads Δ̄ after.
        state_provider: called in the host process when another peer downloads our state;
            returns (metadata, tensors). Set later with :meth:`set_state_provider`.
        **kwargs: passed to DecentralizedAverager.
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht, **kwargs):
        self._bytes_sent = mp.Value(ctypes.c_double, 0.0)
        self._state_provider: StateProvider | None = None
        self._state_lock = threading.Lock()
        super().__init__(averaged_tensors, dht, **kwargs)

    @property
    def last_bytes_sent(self) -> int:
        """Bytes this peer sent in its last all-reduce (tensor payload of the parts)."""
        return int(self._bytes_sent.value)

    def set_state_provider(self, provider: StateProvider | None) -> None:
        with self._state_lock:
            self._state_provider = provider

    def get_current_state(self):
        # Runs in the host process, in hivemind's background thread.
        with self._state_lock:
            if self._state_provider is None:
                raise RuntimeError("this peer has no state to share yet")
            metadata, tensors = self._state_provider()
        return metadata, tensors, None

    def set_target_group_size(self, size: int) -> None:
        """Change how many peers matchmaking waits for before it starts the all-reduce early."""
        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result()

    async def _set_target_group_size(self, size: int, future) -> None:
        self._matchmaking.target_group_size = size
        self._matchmaking.group_key_manager.target_group_size = size
        future.set_result(None)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs) -> None:
        """Run one butterfly all-reduce and apply its result only if it is complete.

        On a partial result (a groupmate failed as sender or as reducer) raises PartialAverage
        and leaves ``tensors`` unchanged.
        """
        group_id = group_info.group_id if group_id is None else group_id
        runner = AllReduceRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                 group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        self._running_groups[group_id].set_result(runner)
        my_index = group_info.peer_ids.index(self.peer_id)
        elements_by_peer = [sum(part.numel() for part, _ in parts)
                            for parts in runner.tensor_part_container._input_parts_by_peer]
        if runner.modes[my_index] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return

        updates = []
        async for tensor, update in azip(as_aiter(*tensors), runner):
            updates.append(update)
        container, reducer = runner.tensor_part_container, runner.tensor_part_reducer
        missing_senders = [i for i, after in enumerate(reducer.sender_failed_after) if after < reducer.num_parts]
        if container.failed_size != 0 or runner.banned_senders or missing_senders:
            raise PartialAverage(
                f"all-reduce of group {group_id.hex()[:8]} was partial: {container.failed_size} of "
                f"{container.total_size} elements not averaged, {len(runner.banned_senders)} groupmate(s) "
                f"dropped as senders"
            )
        for tensor, update in zip(tensors, updates):
            tensor.add_(update, alpha=self._averaging_alpha)
        self.last_updated = get_dht_time()
        self._state_updated.set()
        self._bytes_sent.value = float(_payload_bytes_sent(elements_by_peer, my_index))


def _payload_bytes_sent(elements_by_peer: Sequence[int], my_index: int, element_size: int = 4) -> int:
    """Tensor payload this peer sends in a butterfly all-reduce: its input parts to every other
    reducer, plus the part it reduced, returned to every other groupmate. Excludes framing."""
    others = len(elements_by_peer) - 1
    sent_inputs = sum(n for i, n in enumerate(elements_by_peer) if i != my_index)
    return element_size * (sent_inputs + elements_by_peer[my_index] * others)
