"""Several devices in one peer: data-parallel inner steps over local ranks (torch.distributed).

A peer started with ``--device cuda:0,cuda:1`` (or ``cuda:all``; ``cpu,cpu`` runs two CPU ranks,
for tests) trains on every listed device and still takes part in the swarm as one peer with one
outer step::

    peer process = rank 0      the round loop (peer/round/), DHT, averager, φ and the outer step;
    │                          draws every step's batch and drives the other ranks
    ├── rank 1 (spawned)       a replica of θ and its own AdamW on device 1
    └── rank N-1 (spawned)     ...

Rank 0 broadcasts a command before each sequence of collectives (one inner step, θ, AdamW state,
the micro-batch probe, a θ digest, stop); the other ranks only follow. In a step every rank trains
on its share of the batch (``tensor_split`` by rows, each micro-batch's loss weighted by its share
of the whole batch), the ranks agree on out-of-memory and compile failures, then sum gradients and
loss with all-reduces and run the same clipped AdamW update: θ stays identical on every rank, and
the step equals one process's step over the whole batch with the same micro-batch split (the
all-reduce adds what gradient accumulation would add). The round loop reads rank 0's θ only
(Δ = φ − θ is formed once); when it writes θ (θ ← φ after the outer step, an adopted or restored
state) rank 0 broadcasts θ before the next step. Those writes are noticed from the parameters'
autograd version counters, so the round loop needs no hook.

Why not DistributedDataParallel's backward hooks: with gradient accumulation DDP overlaps only the
last micro-batch's reduction (the others run under ``no_sync``), and an out-of-memory error on one
rank would leave the others blocked inside a backward all-reduce; reducing after the accumulation
lets every rank agree first whether the step succeeded.

Lifetime: ranks are spawned (CUDA cannot be forked) from the peer's main thread, ignore SIGINT and
SIGTERM (the peer's stop path ends them), and the kernel SIGKILLs them when the peer process dies
in any way (peer/net/lifetime.py); multiprocessing's exit handler kills any left.

Both sides of the rank protocol (rank 0's commands, the other ranks' answers) live in this one
file, so their collectives can be read and kept in matching order.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from multiprocessing.process import BaseProcess
from typing import Any, cast

import torch
import torch.distributed as dist

from peer.net.lifetime import HelperProcess
from peer.train.data import BatchSampler
from peer.train.device import cap_memory
from peer.train.inner import InnerLoop, StepResult
from peer.train.model import register_attention
from peer.train.precision import FP32, Precision
from protocol.errors import ConfigError, LocoError, RankFailed
from protocol.manifest import InnerOptimizerSpec

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank waits for the others at a collective (a first torch.compile takes minutes)."""
START_TIMEOUT_S = 300.0
"""How long rank 0 waits for the other ranks to import torch and build their replica."""
BUCKET_ELEMENTS = 1 << 24
"""Gradient elements per all-reduce (64 MiB of fp32): few calls, bounded extra memory."""

_STEP, _THETA, _RESET, _LOAD, _FIT, _DIGEST, _STOP = range(1, 8)


@dataclass(frozen=True)
class RankSetup:
    """What a rank process needs to build its replica and loop (pickled into the spawned process)."""

    rank: int
    world: int
    store_path: str
    """The torch.distributed FileStore that the ranks meet at."""
    backend: str
    device: str
    model_class: type
    model_config: Any
    """The replica is ``model_class(model_config)``, weights from rank 0 (a transformers model)."""
    spec: InnerOptimizerSpec
    precision: Precision
    compile: bool
    micro_batch_sequences: int | None
    batch_sequences: int
    seq_len: int
    threads: int | None
    max_memory_gib: float | None
    activation_checkpointing: bool = False


class _BatchShape:
    """The sampler of a rank other than 0: the batch's shape only (rank 0 draws and sends batches)."""

    def __init__(self, batch_sequences: int, seq_len: int):
        self.batch_sequences, self.seq_len, self.batches_drawn = batch_sequences, seq_len, 0

    def next_batch(self) -> torch.Tensor:
        raise AssertionError("only rank 0 draws batches")


class DistributedInnerLoop(InnerLoop):
    """:class:`InnerLoop` over ``world`` local ranks; the same object type runs on every rank.

    On rank 0 it is what the round loop holds (:meth:`launch` starts the other ranks); its public
    methods first tell the other ranks what to do. On the other ranks :meth:`serve` follows rank 0's
    commands until told to stop.

    Args:
        rank, world: this process's rank and the number of ranks (devices) of the peer.
        comm_device: where collectives' tensors live (the rank's CUDA device with NCCL, the CPU with gloo).
        processes: on rank 0, the other ranks' processes (joined or killed by :meth:`close`).
        store_dir: on rank 0, the directory of the FileStore (removed by :meth:`close`).
        **kwargs: as for :class:`InnerLoop`; ``micro_batch_sequences`` counts per rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: InnerOptimizerSpec,
        sampler,
        *,
        rank: int,
        world: int,
        comm_device: torch.device,
        processes: Sequence[BaseProcess] = (),
        store_dir: str | None = None,
        memory_budget_bytes: float | None = None,
        **kwargs,
    ):
        super().__init__(model, spec, sampler, **kwargs)
        self.rank, self.world, self.comm_device = rank, world, comm_device
        self._processes, self._store_dir = list(processes), store_dir
        self._memory_budget_bytes = memory_budget_bytes
        self._versions: list[int] | None = None
        """θ's version counters after the last step or broadcast (None: θ not shared yet)."""
        self._pending_shape: tuple[int, int] | None = None
        self._broken = self._closed = False
        self._buckets: list[list[torch.nn.Parameter]] = []
        for p in self.params:
            if not self._buckets or sum(q.numel() for q in self._buckets[-1]) + p.numel() > BUCKET_ELEMENTS:
                self._buckets.append([])
            self._buckets[-1].append(p)

    # ---- rank 0: what the round loop calls -----------------------------------------------------
    @classmethod
    def launch(
        cls,
        model: torch.nn.Module,
        spec: InnerOptimizerSpec,
        sampler,
        *,
        devices: Sequence[str],
        precision: Precision = FP32,
        compile: bool = False,
        micro_batch_sequences: int | None = None,
        max_memory_gib: float | None = None,
        activation_checkpointing: bool = False,
    ) -> DistributedInnerLoop:
        """Start ranks 1..N-1 on ``devices[1:]`` and return rank 0's loop on ``devices[0]`` (where
        ``model``, θ, already is). Call from the main thread, after the averager was forked.

        CPU ranks split this process's torch threads between them (rank 0's count is lowered too).

        Raises:
            ConfigError: fewer sequences per step than devices, mixed device types, or a run whose
                inner optimizer is not AdamW.
            RankFailed: a rank did not start (its exit code in the message); nothing is left running.
        """
        world = len(devices)
        if spec.kind != "adamw":
            raise ConfigError(
                f"--device {','.join(devices)}: a peer on several devices runs inner_optimizer.kind "
                f"= 'adamw' only, and this run's is {spec.kind!r}: join with one device"
            )
        types = {torch.device(d).type for d in devices}
        if len(types) != 1 or types & {"mps"}:
            raise ConfigError(f"--device {','.join(devices)}: several devices must all be CUDA cards or all CPU")
        if sampler.batch_sequences < world:
            raise ConfigError(
                f"--device {','.join(devices)}: the run's batch has {sampler.batch_sequences} "
                f"sequence(s), fewer than the {world} devices; list at most {sampler.batch_sequences}"
            )
        if dist.is_available() and dist.is_initialized():
            raise ConfigError("this process already belongs to a torch.distributed group; one peer per process")
        if getattr(model, "config", None) is None:
            raise ConfigError("several devices need a transformers model (rebuilt from its config on each rank)")
        cuda = "cuda" in types
        backend = "nccl" if cuda else "gloo"
        threads = None
        if not cuda:
            threads = max(1, torch.get_num_threads() // world)
            torch.set_num_threads(threads)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks of one box talk over loopback
        store_dir = tempfile.mkdtemp(prefix="locoswarm-ranks-")
        store = os.path.join(store_dir, "store")
        ctx = mp.get_context("spawn")
        processes, ready = [], []
        try:
            for rank in range(1, world):
                setup = RankSetup(
                    rank=rank,
                    world=world,
                    store_path=store,
                    backend=backend,
                    device=devices[rank],
                    model_class=type(model),
                    model_config=getattr(model, "config", None),
                    spec=spec,
                    precision=precision,
                    compile=compile,
                    micro_batch_sequences=micro_batch_sequences,
                    batch_sequences=sampler.batch_sequences,
                    seq_len=sampler.seq_len,
                    threads=threads,
                    max_memory_gib=max_memory_gib,
                    activation_checkpointing=activation_checkpointing,
                )
                event = ctx.Event()
                process = _RankProcess(target=_serve, args=(setup, event), daemon=True, name=f"locoswarm-rank{rank}")
                process.start()
                processes.append(process)
                ready.append(event)
            _wait_ready(processes, ready)
            dist.init_process_group(
                backend,
                init_method=f"file://{store}",
                rank=0,
                world_size=world,
                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                device_id=torch.device(devices[0]) if cuda else None,
            )
        except BaseException:
            for process in processes:
                process.kill()
                process.join(5)
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        device = torch.device(devices[0])
        budget = None
        if cuda:
            total = torch.cuda.get_device_properties(device).total_memory
            budget = min(total, max_memory_gib * 1024**3) if max_memory_gib else total
        logger.info("training on %d ranks (%s) over %s", world, ", ".join(devices), backend)
        return cls(
            model,
            spec,
            sampler,
            rank=0,
            world=world,
            comm_device=device if cuda else torch.device("cpu"),
            processes=processes,
            store_dir=store_dir,
            memory_budget_bytes=budget,
            device=device,
            precision=precision,
            compile=compile,
            micro_batch_sequences=micro_batch_sequences,
            activation_checkpointing=activation_checkpointing,
        )

    def step(self, inner_step: int, *, wait: bool = True) -> StepResult:
        """One AdamW step of the whole peer (:meth:`InnerLoop.step`), every rank on its share of the
        batch; θ written since the last step is broadcast from rank 0 first.

        Raises:
            BadPayload, ConfigError: as :meth:`InnerLoop.step`, on every rank alike.
            RankFailed: another rank died or a collective failed; the peer cannot go on.
        """
        with self._collective(f"inner step {inner_step}"):
            if self.rank == 0:
                self._share_theta_if_written()
            try:
                return super().step(inner_step, wait=wait)
            finally:
                self._versions = self._param_versions()

    def reset_optimizer(self) -> None:
        with self._collective("resetting AdamW"):
            self._send(_RESET)
            super().reset_optimizer()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore AdamW's state on every rank from rank 0's ``state`` (see :meth:`InnerLoop.load_state_dict`)."""
        with self._collective("restoring AdamW"):
            self._send(_LOAD, 0 if state is None else 1, 0 if state is None else int(state["step"]))
            self._load(state)

    def fit_micro_batch(self, *, budget_bytes: float, margin: float = 0.1) -> int:
        """The largest micro-batch that fits every rank's card (each probes its own, rank 0 under
        ``budget_bytes``, the others under their card or ``--max-memory``); the smallest wins."""
        with self._collective("probing the micro-batch"):
            self._send(_FIT)
            return self._fit(budget_bytes if self.rank == 0 else self._memory_budget_bytes, margin)

    def theta_digests(self) -> list[str]:
        """SHA-256 of every rank's θ (fp32 bytes in parameter order), rank 0 first: all equal while
        the ranks agree."""
        with self._collective("comparing θ"):
            self._send(_DIGEST)
            return self._digests()

    def close(self) -> None:
        """Stop the other ranks (killed after 30 s, or at once after a failure) and leave the group.
        Idempotent; on ranks other than 0 a no-op."""
        if self.rank != 0 or self._closed:
            return
        self._closed = True
        if not self._broken:
            try:
                self._send(_STOP)
            except Exception as exc:  # a dead rank; killed below
                logger.debug("stopping the ranks: %s", exc)
                self._broken = True
        for process in self._processes:
            process.join(0 if self._broken else 30)
            if process.is_alive():
                process.kill()
                process.join(5)
        if not self._broken or self.comm_device.type == "cpu":
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)

    # ---- every rank ------------------------------------------------------------------------------
    def serve(self) -> None:
        """Ranks other than 0: follow rank 0's commands until it says stop. Our errors that every
        rank raises alike (a non-finite loss, nothing fits) are left to rank 0 to report."""
        while True:
            op, a, b, c = self._receive()
            try:
                if op == _STEP:
                    self._pending_shape = (b, c)
                    super().step(a)
                    self._versions = None
                elif op == _THETA:
                    self._broadcast_theta()
                elif op == _RESET:
                    super().reset_optimizer()
                elif op == _LOAD:
                    self._load(None if a == 0 else {"step": b})
                elif op == _FIT:
                    self._fit(self._memory_budget_bytes, 0.1)
                elif op == _DIGEST:
                    self._digests()
                elif op == _STOP:
                    return
                else:
                    raise AssertionError(f"unknown command {op} from rank 0")
            except LocoError as exc:
                logger.debug("rank %d: %s", self.rank, exc)

    def _send(self, op: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        if self.rank == 0:
            dist.broadcast(torch.tensor([op, a, b, c], dtype=torch.int64, device=self.comm_device), src=0)

    def _receive(self) -> tuple[int, int, int, int]:
        command = torch.zeros(4, dtype=torch.int64, device=self.comm_device)
        dist.broadcast(command, src=0)
        op, a, b, c = (int(x) for x in command.tolist())
        return op, a, b, c

    def _next_batch(self, inner_step: int) -> torch.Tensor:
        if self.rank == 0:
            batch = self.sampler.next_batch()
            self._send(_STEP, inner_step, *batch.shape)
            batch = batch.to(self.comm_device)
        else:
            assert self._pending_shape is not None  # rank 0's _STEP command carried it
            batch = torch.empty(self._pending_shape, dtype=torch.int64, device=self.comm_device)
        dist.broadcast(batch, src=0)
        return batch

    def _share(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.tensor_split(self.world)[self.rank]

    @property
    def rows_per_step(self) -> int:
        """Sequences of the largest share (ranks' shares differ by at most one)."""
        return math.ceil(self.sampler.batch_sequences / self.world)

    def _forward_backward(self, batch: torch.Tensor) -> float:
        share = self._share(batch)
        while True:
            oom, compile_failure = False, None
            try:
                loss = self._accumulate_share(share, batch.shape[0])
            except torch.OutOfMemoryError:
                oom = True
            except Exception as exc:  # a first compiled step's failure falls back
                if not self._compile_unproven:
                    raise
                compile_failure = RuntimeError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            flags = torch.tensor([float(oom), float(compile_failure is not None)], device=self.comm_device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank backs off or falls back alike
            if flags[0] > 0:
                self._back_off(self.rows_per_step)  # the same size on every rank, whichever ran out
            elif flags[1] > 0:
                self._fall_back_to_eager(compile_failure or RuntimeError("torch.compile failed on another rank"))
            else:
                return self._reduce(loss)

    def _reduce(self, loss: torch.Tensor) -> float:
        """Sum the shares' gradients and losses over the ranks (the whole batch's)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in self._buckets:
            grads = [cast(torch.Tensor, p.grad) for p in bucket]  # each set above
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        total = loss.detach().reshape(1).to(self.comm_device, torch.float32)
        dist.all_reduce(total)
        return total.item()

    def _param_versions(self) -> list[int]:
        return [p._version for p in self.params]

    def _share_theta_if_written(self) -> None:
        if self._versions != self._param_versions():
            self._send(_THETA)
            self._broadcast_theta()

    def _broadcast_theta(self) -> None:
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.detach(), src=0)
        self._versions = self._param_versions()

    def _load(self, state: dict[str, Any] | None) -> None:
        if self.rank == 0 or state is None:
            super().load_state_dict(state)
        else:  # placeholders that rank 0's tensors overwrite below
            zeros = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
            super().load_state_dict({"exp_avg": zeros, "exp_avg_sq": [z.clone() for z in zeros], "step": state["step"]})
        if state is not None:
            for p in self.params:
                dist.broadcast(self._adamw().state[p]["exp_avg"], src=0)
                dist.broadcast(self._adamw().state[p]["exp_avg_sq"], src=0)

    def _fit(self, budget_bytes: float | None, margin: float) -> int:
        try:
            fits = InnerLoop.fit_micro_batch(self, budget_bytes=budget_bytes, margin=margin) if budget_bytes else 0
        except ConfigError:
            fits = 0
        smallest = torch.tensor([fits], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        if int(smallest) == 0:
            raise ConfigError(
                "the model does not fit one of this peer's devices even at one sequence per "
                "micro-batch; list fewer or larger cards, raise --max-memory, or train a smaller run"
            )
        self.micro_batch_sequences = int(smallest)
        return self.micro_batch_sequences

    def _digests(self) -> list[str]:
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        mine = torch.tensor(list(h.digest()), dtype=torch.uint8, device=self.comm_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        return [bytes(t.cpu().tolist()).hex() for t in everyone]

    def _dead_ranks(self) -> list[str]:
        return [f"rank {i} exited with code {q.exitcode}" for i, q in enumerate(self._processes, 1) if not q.is_alive()]

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Rank 0: a failed collective (a dead rank) becomes RankFailed and marks the group broken."""
        if self._closed:
            raise RankFailed(f"{what}: this peer's ranks were already stopped")
        if dead := self._dead_ranks():  # gloo may miss a dead rank on a send (and wait out its timeout)
            self._broken = True
            raise RankFailed(f"{what}: {'; '.join(dead)}; see the log above, or run with one --device")
        try:
            yield
        except LocoError:
            raise
        except Exception as exc:
            self._broken = True
            if self.rank != 0:
                raise
            dead = self._dead_ranks()
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RankFailed(
                f"{what} failed across this peer's {self.world} ranks "
                f"({'; '.join(dead) or 'all ranks alive'}): {first}; see the log above, "
                f"or run with one --device"
            ) from exc
        except BaseException:
            self._broken = True  # e.g. a second Ctrl-C inside a collective: the others are mid-sequence
            raise


class _RankProcess(HelperProcess, SpawnProcess):
    """A spawned rank: ignores SIGINT/SIGTERM, SIGKILLed when the peer process dies (lifetime.py)."""


def _wait_ready(processes: Sequence[BaseProcess], ready: list) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for rank, (process, event) in enumerate(zip(processes, ready), start=1):
        while not event.wait(0.2):
            if not process.is_alive():
                raise RankFailed(
                    f"rank {rank} exited with code {process.exitcode} while starting; its error is "
                    f"in the log above (run with one --device to train without it)"
                )
            if time.monotonic() > deadline:
                raise RankFailed(f"rank {rank} did not start within {START_TIMEOUT_S:.0f} s")


def _serve(setup: RankSetup, ready) -> None:
    """Body of a rank process other than 0: build the replica, join the group, follow rank 0."""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s rank{setup.rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if setup.threads:
        torch.set_num_threads(setup.threads)
    device = torch.device(setup.device)
    budget = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        cap_memory(device, setup.max_memory_gib)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = min(total, setup.max_memory_gib * 1024**3) if setup.max_memory_gib else total
    register_attention()  # the config names locoswarm's attention, registered per process
    model = setup.model_class(setup.model_config).float().to(device)  # weights come from rank 0
    ready.set()
    dist.init_process_group(
        setup.backend,
        init_method=f"file://{setup.store_path}",
        rank=setup.rank,
        world_size=setup.world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,
    )  # NCCL binds its card
    try:
        loop = DistributedInnerLoop(
            model,
            setup.spec,
            _BatchShape(setup.batch_sequences, setup.seq_len),
            rank=setup.rank,
            world=setup.world,
            comm_device=device if device.type == "cuda" else torch.device("cpu"),
            memory_budget_bytes=budget,
            device=device,
            precision=setup.precision,
            compile=setup.compile,
            micro_batch_sequences=setup.micro_batch_sequences,
            activation_checkpointing=setup.activation_checkpointing,
        )
        loop.serve()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def make_inner_loop(
    model: torch.nn.Module, spec: InnerOptimizerSpec, sampler: BatchSampler, placement: Any = None
) -> InnerLoop:
    """The inner loop a :class:`peer.train.device.Placement` asks for: an :class:`InnerLoop` on its
    device (on the CPU in fp32 without one), or, for several devices, rank 0 of a
    :class:`DistributedInnerLoop` with the other ranks started (``close()`` ends them).

    Raises:
        ConfigError, RankFailed: see :meth:`DistributedInnerLoop.launch`.
    """
    if placement is None:
        return InnerLoop(model, spec, sampler)
    settings = dict(
        precision=placement.precision,
        compile=placement.compile,
        micro_batch_sequences=placement.micro_batch_sequences,
        activation_checkpointing=getattr(placement, "activation_checkpointing", False),
    )
    if len(placement.devices) > 1:
        return DistributedInnerLoop.launch(
            model, spec, sampler, devices=placement.devices, max_memory_gib=placement.max_memory_gib, **settings
        )
    return InnerLoop(model, spec, sampler, device=placement.device, **settings)
