"""`peer doctor`: the checks a volunteer runs before joining, on this machine alone.

Device, memory, the precision this peer would train in, the micro-batch that fits the run's
model, tokens/s and MFU over a few real inner steps (on random tokens of the run's vocabulary,
so no corpus is read), and versions; with initial peers (:func:`check_swarm`), whether any of
them answers, whether they can dial this machine back on the port ``peer join`` would listen on
(peer/net/reachability.py), and the measured uplink to them (peer/net/uplink.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import resource
import time
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TextIO, cast

import torch

from peer import reachability
from peer.net import dht as swarm_dht
from peer.net.identity import ensure_identity
from peer.net.uplink import measure_uplink
from peer.progress import Waiting
from peer.run_choice import choose_run
from peer.state import memory_check, memory_need
from peer.train.data import BatchSampler
from peer.train.ddp import make_inner_loop
from peer.train.device import Placement, flops_per_token, mfu, place
from peer.train.model import build_model, embedding_parameter_count, parameter_count
from peer.train.tokenizer import byte_tokenizer
from protocol.errors import ConfigError, LocoError, NetworkError
from protocol.manifest import RunManifest


@dataclass
class DoctorReport:
    """What ``peer doctor`` found; ``problems`` lists each failed check with what to do."""

    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    network_problems: list[str] = field(default_factory=list)
    """Failed network checks (no initial peer answered), apart: they exit 69, not 78."""

    @property
    def can_contribute(self) -> bool:
        return not self.problems and not self.network_problems

    @property
    def exit_code(self) -> int:
        """0 when this peer can contribute; 78 for a problem of this machine; 69 when only the swarm
        could not be reached (sysexits, as ``peer join``)."""
        return 0 if self.can_contribute else 78 if self.problems else 69


class Checks:
    """How ``peer doctor`` says each check as it starts (``peer doctor: measuring the uplink ...``), and
    while one runs long, that it still runs (peer/progress.py ``Waiting``: a line every ``every_s``, a spinner
    on a terminal), on ``stream``; says nothing with ``stream=None`` (the library default).

    Args:
        stream: where the lines go (the command: stderr, so stdout carries the report or its JSON).
        every_s: longest silence while a check runs, s.
    """

    def __init__(self, stream: TextIO | None = None, *, every_s: float = 4.0):
        self.stream, self.every_s = stream, every_s

    @contextlib.contextmanager
    def check(self, what: str) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        print(f"peer doctor: {what}", file=self.stream, flush=True)
        with Waiting(what, stream=self.stream, every_s=self.every_s):
            yield


class HostLoad:
    """CPU time the other processes of this machine take while a measurement runs: the busy time
    of every core (Linux ``/proc/stat``) less this process's own (``getrusage``), over the wall time.
    Elsewhere (no ``/proc/stat``), the 1-minute load average less one (this process).

    Use as a context manager around the measurement; then ``others_cores`` is how many cores the
    other work kept busy on average (0.0 to ``cores``)."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.others_cores = 0.0
        self.load_average = 0.0

    @staticmethod
    def _busy_s() -> float | None:
        """Seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal); None
        without ``/proc/stat``."""
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = sum(fields[:8]) - idle  # guest time is already in user
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        return own.ru_utime + own.ru_stime

    def __enter__(self) -> HostLoad:
        self._t0, self._busy0, self._own0 = time.monotonic(), self._busy_s(), self._own_s()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.monotonic() - self._t0, 1e-3)
        busy1 = self._busy_s()
        self.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if busy1 is None or self._busy0 is None:
            others = self.load_average - 1.0
        else:
            others = (busy1 - self._busy0 - (self._own_s() - self._own0)) / wall
        self.others_cores = min(float(self.cores), max(0.0, others))

    @property
    def shared(self) -> bool:
        """Whether other work took enough of the CPU to slow the measurement down: half a core, or a
        tenth of the cores on a larger machine."""
        return self.others_cores >= max(HOST_SHARED_CORES, 0.1 * self.cores)


HOST_SHARED_CORES = 0.5
"""Cores other processes must keep busy during the timed steps before the report says the
throughput was measured on a shared host (a lower bound)."""


class RandomTokens:
    """Batches of the run's shape drawn from its vocabulary (a sampler without a corpus)."""

    def __init__(self, manifest: RunManifest, vocab_size: int):
        self.seq_len, self.batch_sequences = manifest.data.seq_len_tokens, manifest.batch_sequences
        self.vocab_size, self.batches_drawn = vocab_size, 0
        self.generator = torch.Generator().manual_seed(0)

    def next_batch(self) -> torch.Tensor:
        self.batches_drawn += 1
        return torch.randint(0, self.vocab_size, (self.batch_sequences, self.seq_len + 1), generator=self.generator)


def vocab_tokenizer(manifest: RunManifest):
    """The byte tokenizer, or a stand-in with the BPE's vocabulary size (the model needs only the ids)."""
    tokenizer = byte_tokenizer()
    if manifest.data.tokenizer == "bytes":
        return tokenizer
    v = manifest.data.vocab_size
    return dataclasses.replace(tokenizer, vocab_size=v, bos_id=v - 3, eos_id=v - 2, pad_id=v - 1)


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("locoswarm", "transformers", "hivemind"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["cuda"] = torch.version.cuda or "none"
    return found


UPLINK_LOW_MBIT_S = 5.0
"""Below this measured uplink a peer still contributes, but its syncs are slow: the report says so."""


def check_swarm(
    report: DoctorReport,
    initial_peers: Sequence[str],
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    timeout_s: float = 20.0,
    local: RunManifest | None = None,
    local_flag: str = "--run/--preset",
    run_id: str | None = None,
    checkpoints: Set[str] = frozenset(),
    announce_wait_s: float = 5.0,
    checks: Checks | None = None,
) -> RunManifest | None:
    """What the swarm sees of this machine: starts a DHT node listening on ``host:port`` (as ``peer
    join`` would, with a throwaway identity, so a peer running here keeps its own), then

    * whether any of ``initial_peers`` answers (``swarm``: 'answered' or 'unreachable',
      ``swarm_connect_s``);
    * whether they can dial this node back (``reachability``: 'reachable', 'unreachable' or
      'unknown', ``reachability_line``; peer/reachability.py ``check``);
    * the uplink to them (``uplink_mbit_s``, ``uplink_bytes``, ``uplink_s``; peer/net/uplink.py);
    * the run ``peer join`` would train there (:func:`swarm_run`, with ``local``, ``run_id`` and
      ``checkpoints`` as ``peer join``'s ``--run``/``--preset``, ``--run-id`` and data dir).

    Returns:
        The manifest of that run, for :func:`diagnose` to size; None when the swarm did not answer
        or no run could be chosen (``report.problems`` says why; ``local`` is then sized).

    Results go to ``report.facts``. No answer from the swarm goes to ``report.network_problems`` with
    what to do; a peer nobody can dial, or a slow uplink, still contributes (client mode, relayed):
    those go to ``report.facts["network_notes"]``. The node is shut down before returning. Call
    before :func:`diagnose` on a CUDA machine (the DHT forks its process before CUDA is touched).
    ``checks`` says each check as it starts (:class:`Checks`).
    """
    import tempfile
    from pathlib import Path

    checks = checks or Checks()
    notes = report.facts.setdefault("network_notes", [])
    start = time.monotonic()
    where = f"{host}:{port}" if port else f"{host}, any free port"
    with tempfile.TemporaryDirectory(prefix="locoswarm-doctor-") as tmp:
        identity = ensure_identity(Path(tmp) / "identity.key")
        try:
            with checks.check(f"starting a DHT node on {where}, dialing {len(initial_peers)} initial peer(s)"):
                dht = reachability.start_node(
                    list(initial_peers),
                    host=host,
                    port=port,
                    announce=(),
                    identity_path=str(identity),
                    client_mode=False,
                    timeout_s=timeout_s,
                )
        except (NetworkError, ConfigError) as exc:
            report.facts["swarm"] = "unreachable"
            report.network_problems.append(
                f"{exc}; check the address and that its node runs, and that this "
                "machine may open outbound TCP connections"
            )
            return None
        try:
            report.facts.update(swarm="answered", swarm_connect_s=round(time.monotonic() - start, 2))
            with checks.check("asking the swarm to dial this machine back"):
                verdict = reachability.check(dht, initial_peers)
            report.facts.update(reachability=verdict.status, reachability_line=verdict.line)
            if verdict.status == "unreachable":
                notes.append(
                    "the swarm cannot dial this machine: peer join goes on in client mode (it trains, "
                    "but serves no state to joiners); to be dialable, forward the TCP port and pass "
                    "--port PORT --announce /ip4/PUBLIC_IP/tcp/PORT"
                )
            with checks.check("measuring the uplink to the swarm (a few MiB of random bytes)"):
                probe = measure_uplink(dht, reachability.peer_ids(initial_peers))
            report.facts.update(
                uplink_mbit_s=probe.mbit_per_s,
                uplink_bytes=probe.bytes,
                uplink_s=round(probe.seconds, 3),
                uplink_error=probe.error or None,
            )
            if probe.mbit_per_s is not None and probe.mbit_per_s < UPLINK_LOW_MBIT_S:
                notes.append(
                    f"uplink {probe.mbit_per_s:.1f} Mbit/s: each sync will take long; a lossy codec "
                    "(run manifest [compression]) or a larger H moves fewer bytes per token"
                )
            with checks.check("looking for the run the swarm announces"):
                return swarm_run(
                    report,
                    dht,
                    local=local,
                    local_flag=local_flag,
                    run_id=run_id,
                    checkpoints=checkpoints,
                    wait_s=announce_wait_s,
                )
        finally:
            dht.shutdown()


def swarm_run(
    report: DoctorReport,
    dht,
    *,
    local: RunManifest | None = None,
    local_flag: str = "--run/--preset",
    run_id: str | None = None,
    checkpoints: Set[str] = frozenset(),
    wait_s: float = 5.0,
) -> RunManifest | None:
    """The run ``peer join`` would train in the swarm ``dht`` is part of: its validly signed
    announced runs (read for up to ``wait_s`` while none is found), chosen as ``peer join`` chooses
    (peer/run_choice.py). Sets ``report.facts["swarm_run"]`` (run id, name, and whether this peer
    would start it); a choice ``peer join`` would refuse goes to ``report.problems`` with its
    message, as does a run whose ``data.path`` a joiner refuses.

    Returns:
        The chosen manifest (``local`` when this peer would start it), or None: no run to size
        (the swarm announces none and none is given, or the choice failed).
    """

    deadline = time.monotonic() + wait_s
    while True:
        try:
            announced = {rid: s.manifest for rid, s in swarm_dht.list_announced(dht).items()}
        except NetworkError:
            announced = {}
        if announced or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    try:
        chosen = choose_run(announced, local=local, local_flag=local_flag, run_id=run_id, checkpoints=checkpoints)
        if chosen is None or (chosen not in announced and local is not None and chosen == local.run_id):
            assert local is not None
            report.facts["swarm_run"] = {"run_id": local.run_id, "name": local.name, "announced": False}
            report.facts.setdefault("network_notes", []).append(
                f"the swarm does not announce {local_flag} ({local.name!r}): peer join would start it as a new run"
            )
            return local
        manifest = (
            announced[chosen] if chosen in announced else swarm_dht.fetch_manifest(dht, chosen, allow_data_path=True)
        )
    except LocoError as exc:  # RunChoiceNeeded, ManifestNotFound, ManifestError
        report.facts["swarm_run"] = None
        report.problems.append(f"{exc} (peer join would stop here too)")
        return None
    report.facts["swarm_run"] = {"run_id": manifest.run_id, "name": manifest.name, "announced": True}
    if local is None or not manifest.same_content(local):
        try:
            swarm_dht.refuse_local_data_path(manifest)
        except ConfigError as exc:
            report.problems.append(str(exc))
    if manifest.data.source != "python-stdlib" and not manifest.data.path:
        report.facts.setdefault("network_notes", []).append(
            f"run {manifest.run_id} names its corpus by content (data.corpus_sha256 = {manifest.data.corpus_sha256}): "
            "peer join needs --data PATH pointing at your copy of it"
        )
    return manifest


def diagnose(
    manifest: RunManifest,
    *,
    device: str = "auto",
    precision: str = "auto",
    compile: bool | None = None,
    micro_batch_sequences: int | None = None,
    max_memory_gib: float | None = None,
    peak_tflops: float | None = None,
    activation_checkpointing: bool = False,
    steps: int = 3,
    report: DoctorReport | None = None,
    checks: Checks | None = None,
) -> DoctorReport:
    """Run the local checks for training ``manifest`` here; never raises for a failed check (it goes
    into ``problems``). Trains ``steps`` + 1 inner steps (the first one warms up, untimed) on a
    throwaway copy of the run's model, and measures what else keeps this machine's CPU busy
    meanwhile (:class:`HostLoad`: ``host_other_cores``, ``host_cores``, ``host_shared``; a shared
    host makes the throughput a lower bound). Adds to ``report`` when given (after
    :func:`check_swarm`); ``checks`` says each check as it starts (:class:`Checks`)."""
    checks = checks or Checks()
    report = DoctorReport() if report is None else report
    report.facts["versions"] = _versions()
    try:
        with checks.check(f"checking the device ({device}, precision {precision})"):
            placement, notes = place(
                device,
                precision=precision,
                compile=compile,
                micro_batch_sequences=micro_batch_sequences,
                max_memory_gib=max_memory_gib,
                peak_tflops=peak_tflops,
                activation_checkpointing=activation_checkpointing,
            )
    except ConfigError as exc:
        report.problems.append(str(exc))
        return report
    report.facts.update(placement.event_fields(), notes=notes, memory_budget_gib=placement.memory_budget_gib)
    if not check_memory_need(report, manifest, placement):  # before the model is built: it may not fit
        return report
    tokenizer = vocab_tokenizer(manifest)
    with checks.check(f"building the model of run {manifest.name!r} on {placement.device}"):
        model = build_model(manifest.model, tokenizer).to(placement.device)
    n = parameter_count(model)
    report.facts.update(run=manifest.name, parameters=n, batch_sequences=manifest.batch_sequences)
    try:
        # several devices: the ranks start here and the timed steps are the whole peer's
        # (the loop only draws batches: next_batch, batch_sequences and seq_len, which RandomTokens has)
        loop = make_inner_loop(
            model, manifest.inner_optimizer, cast(BatchSampler, RandomTokens(manifest, tokenizer.vocab_size)), placement
        )
    except LocoError as exc:
        report.problems.append(str(exc))
        return report
    load = HostLoad()
    try:
        if placement.device.type == "cuda" and micro_batch_sequences is None and placement.memory_budget_gib:
            with checks.check("fitting the largest micro-batch"):
                loop.fit_micro_batch(budget_bytes=placement.memory_budget_gib * 1024**3)
        with checks.check(f"timing the inner steps: one to warm up, then {steps}"):
            loop.step(0)
            if placement.device.type == "cuda":
                torch.cuda.synchronize(placement.device)
            with load:
                start, tokens = time.perf_counter(), 0
                for k in range(steps):
                    tokens += loop.step(1 + k).tokens
                if placement.device.type == "cuda":
                    torch.cuda.synchronize(placement.device)
                seconds = time.perf_counter() - start
    except LocoError as exc:
        report.problems.append(f"{exc}; {fit_advice(manifest, placement.device.type, activation_checkpointing)}")
        return report
    except torch.OutOfMemoryError:
        report.problems.append(
            f"run {manifest.name!r} ({n:,} parameters) ran out of memory on {placement.device}; "
            f"{fit_advice(manifest, placement.device.type, activation_checkpointing)}"
        )
        return report
    finally:
        loop.close()
    rate = tokens / max(seconds, 1e-9)
    per_token = flops_per_token(
        params=n,
        embedding_params=embedding_parameter_count(model),
        layers=manifest.model.num_layers,
        hidden=manifest.model.hidden_size,
        seq_len=manifest.data.seq_len_tokens,
    )
    report.facts.update(
        micro_batch=loop.micro_batch_sequences or loop.rows_per_step,
        compile=loop.compiled,
        tokens_per_s=rate,
        mfu=mfu(rate, per_token, placement.peak_tflops),
        seconds_per_inner_step=seconds / steps,
        seconds_per_round=seconds / steps * manifest.sync.inner_steps,
        host_cores=load.cores,
        host_other_cores=round(load.others_cores, 2),
        host_load_average=round(load.load_average, 2),
        host_shared=load.shared,
    )
    return report


def check_memory_need(report: DoctorReport, manifest: RunManifest, placement: Placement) -> bool:
    """The host RAM and GPU memory a peer of ``manifest`` needs here (peer/state/memory_need.py)
    against what is free (``memory_host_need_gib``, ``memory_host_available_gib``,
    ``memory_gpu_need_gib``, ``memory_gpu_free_gib``); whether it fits (else the refusal line is in
    ``report.problems``)."""
    need = memory_need.memory_need(
        manifest,
        device_type=placement.device.type,
        precision=placement.precision.name,
        micro_batch_sequences=placement.micro_batch_sequences,
        activation_checkpointing=placement.activation_checkpointing,
    )
    host_free = memory_check.host_available_bytes()
    gpu_free = memory_check.gpu_free_bytes(placement.device)
    gib = memory_need.GIB
    report.facts.update(
        memory_host_need_gib=round(need.host_bytes / gib, 2),
        memory_host_available_gib=None if host_free is None else round(host_free / gib, 2),
        memory_gpu_need_gib=round(need.gpu_bytes / gib, 2) if need.device_type == "cuda" else None,
        memory_gpu_free_gib=None if gpu_free is None else round(gpu_free / gib, 2),
    )
    line = memory_check.shortfall(need, host_free=host_free, gpu_free=gpu_free, device=str(placement.device))
    if line is not None:
        report.problems.append(line)
    return line is None


def fit_advice(manifest: RunManifest, device_type: str, activation_checkpointing: bool) -> str:
    """What to change so that ``manifest``'s model fits this peer, as one clause."""
    ways = []
    if not activation_checkpointing:
        ways.append("--activation-checkpointing (recompute activations: a larger micro-batch fits)")
    if device_type == "cuda":
        ways += [
            "peer join --micro-batch 1",
            (
                "a larger --max-memory, or a card with more memory (--device cuda:N, or a list "
                "of cards to train data-parallel)"
            ),
        ]
    else:
        ways.append("a CUDA card (--device cuda), or close other programs to free memory")
    return (
        f"to train run {manifest.name!r} ({manifest.model.num_layers} layers, hidden {manifest.model.hidden_size}, "
        f"seq_len {manifest.data.seq_len_tokens}) here, try " + "; ".join(ways) + "; else join a swarm of a smaller run"
    )


def render(report: DoctorReport) -> list[str]:
    """The report as lines for a person: one fact per line, then each problem with what to do."""
    f = report.facts
    lines = ["versions: " + ", ".join(f"{k} {v}" for k, v in f.get("versions", {}).items())]
    run = f.get("swarm_run")
    if run:
        lines.append(
            f"swarm run: {run['name']} (run id {run['run_id']}), "
            + (
                "the run the swarm announces: its model is sized below"
                if run.get("announced")
                else "not announced by the swarm (peer join would start it): its model is sized below"
            )
        )
    if "device" in f:
        memory = (
            f"{f['device_memory_gib']:.1f} GiB" if f.get("device_memory_gib") is not None else "shared with the system"
        )
        cap = (
            f"compute capability {f['compute_capability']}" if f.get("compute_capability") else "no compute capability"
        )
        lines.append(f"device: {f['device']} ({f['device_name']}), memory {memory}, {cap}")
        lines.append(f"precision: {f['precision']}")
        lines += [f"note: {n}" for n in f.get("notes", [])]
    if f.get("memory_host_need_gib") is not None:
        lines.append(memory_line(f))
    if "tokens_per_s" in f:
        lines.append(
            f"run {f['run']}: {f['parameters']:,} parameters, micro-batch {f['micro_batch']} of "
            f"{f['batch_sequences']} sequences{', on each of ' + str(f['ranks']) + ' ranks' if f.get('ranks', 1) > 1 else ''}"
            f"{', compiled' if f['compile'] else ''}"
        )
        mfu_text = f", MFU {100 * f['mfu']:.1f} %" if f.get("mfu") is not None else ""
        lines.append(
            f"throughput: {f['tokens_per_s']:,.0f} tok/s{mfu_text}; {f['seconds_per_inner_step']:.2f} s per "
            f"inner step, about {f['seconds_per_round']:,.0f} s per round"
        )
        if f.get("host_shared"):
            lines.append(
                f"note: the measurement shared the host with other work (load {f['host_other_cores']:.1f} on "
                f"{f['host_cores']} cores): the throughput is a lower bound, and a round takes less than "
                "this once the other work stops"
            )
    if "swarm" in f:
        lines.append(
            f"swarm: an initial peer answered in {f['swarm_connect_s']:.1f} s"
            if f["swarm"] == "answered"
            else "swarm: no initial peer answered"
        )
    if f.get("reachability_line"):
        lines.append(f"dialable: {f['reachability_line']}")
    if f.get("uplink_mbit_s") is not None:
        lines.append(
            f"uplink: {f['uplink_mbit_s']:,.1f} Mbit/s ({f['uplink_bytes'] / 2**20:.0f} MiB in "
            f"{f['uplink_s']:.2f} s, one round trip included)"
        )
    elif f.get("uplink_error"):
        lines.append(f"uplink: not measured ({f['uplink_error']})")
    lines += [f"note: {n}" for n in f.get("network_notes", [])]
    lines += [f"problem: {p}" for p in [*report.network_problems, *report.problems]]
    lines.append("ok: this peer can contribute" if report.can_contribute else "this peer cannot contribute as it is")
    return lines


def memory_line(f: dict[str, Any]) -> str:
    """``memory: needs 6.4 GiB of host RAM (20.1 GiB available), 5.4 GiB on cuda:0 (70.2 GiB free)``."""

    def free(key: str, word: str) -> str:
        return f" ({f[key]:.1f} GiB {word})" if f.get(key) is not None else ""

    line = (
        f"memory: needs {f['memory_host_need_gib']:.1f} GiB of host RAM{free('memory_host_available_gib', 'available')}"
    )
    if f.get("memory_gpu_need_gib") is not None:
        line += f", {f['memory_gpu_need_gib']:.1f} GiB on {f['device']}{free('memory_gpu_free_gib', 'free')}"
    return line + " (per-buffer estimate: docs/memory.md)"
