"""The settings of one peer, as opposed to what the run is (the run manifest, protocol/manifest.py).

Resolved once by the CLI (flag > environment > default) and handed down: ``peer join``'s
:class:`JoinConfig` to the node assembly (peer/node.py), its ``trainer`` part to the round loop
(peer/round/). Per-peer facts live here and never enter the run id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.manifest import RunManifest

AUTO_CHECKPOINT_EVERY_ROUND_BYTES = 256 * 2**20
"""With ``checkpoint_every_s`` None, a checkpoint under this many bytes is written every round."""
AUTO_CHECKPOINT_EVERY_S = 600.0
"""With ``checkpoint_every_s`` None, a larger checkpoint is written at most every this many seconds."""


def checkpoint_bytes(*, parameters: int, outer_state: int) -> int:
    """The fp32 tensors of a checkpoint (peer/state/checkpoint.py), in bytes: φ, θ and AdamW's two
    moments (``parameters`` elements each) and the outer state (``outer_state`` elements, e.g. the
    outer momentum: as many again). About 20 bytes a parameter; the error-feedback residuals and the
    small fields are left out."""
    return 4 * (4 * parameters + outer_state)


def checkpoint_interval_s(every_s: float | None, size_bytes: int) -> float:
    """The round-end checkpoint interval a peer uses (``checkpoint_due``'s ``every_s``): ``every_s``
    when given (``--checkpoint-every``; 0: every round), else sized to the checkpoint: every round
    (0) under :data:`AUTO_CHECKPOINT_EVERY_ROUND_BYTES` (the default and tiny models, a few MB), else
    :data:`AUTO_CHECKPOINT_EVERY_S` (llama-125m's 2.5 GB is not written every minute-long round)."""
    if every_s is not None:
        return every_s
    return 0.0 if size_bytes < AUTO_CHECKPOINT_EVERY_ROUND_BYTES else AUTO_CHECKPOINT_EVERY_S


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """What this peer does, as opposed to what the run is (the manifest)."""

    max_rounds: int | None = None
    """Stop once the run reaches this round; None trains until stopped."""
    eval_every_rounds: int = 0
    """Evaluate φ every k rounds (0: only at the start and the end)."""
    checkpoint_path: Path | None = None
    state_download_timeout_s: float = 5.0
    """A donor that sends nothing for this long during a state download is dropped (its chunks go
    to the other donors)."""
    checkpoint_every_s: float | None = None
    """Write the checkpoint at a round's end at most every this many seconds (0: every round). A
    checkpoint holds φ, the outer state, θ and AdamW's two moments, fp32: 2.5 GB at ~125 M
    parameters, so a peer with minute-long rounds would write ~150 GB an hour at 0. None: sized to
    the model (:func:`checkpoint_interval_s`): every round under 256 MiB of checkpoint, else at most
    every 600 s. A stop always writes one."""
    export_phi_every_rounds: int = 0
    """Write φ to ``phi-round-NNNNNN.safetensors`` beside the checkpoint every k rounds (0: never)."""
    wait_for_peers: int = 1
    """Before the first round, wait until this many peers (this one included) are live in the DHT."""
    wait_for_peers_timeout_s: float = 120.0
    serves_state: bool = True
    """Whether others can download this peer's state. False in client mode (nobody can dial it): its
    progress records then publish no state digest, so no peer picks it as a donor."""

    def __post_init__(self) -> None:
        if self.max_rounds is not None and self.max_rounds < 0:
            raise ValueError(f"max_rounds = {self.max_rounds}: must be >= 0")
        if self.wait_for_peers < 1:
            raise ValueError(f"wait_for_peers = {self.wait_for_peers}: must be >= 1")
        if self.checkpoint_every_s is not None and not 0.0 <= self.checkpoint_every_s < float("inf"):
            raise ValueError(
                f"checkpoint_every_s = {self.checkpoint_every_s}: must be a finite number >= 0 "
                "(or None: sized to the model)"
            )
        if self.export_phi_every_rounds < 0:
            raise ValueError(f"export_phi_every_rounds = {self.export_phi_every_rounds}: must be >= 0")
        if self.eval_every_rounds < 0:
            raise ValueError(f"eval_every_rounds = {self.eval_every_rounds}: must be >= 0")


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """Where and how this peer trains (peer/train/device.py): per-peer facts, never in the manifest."""

    device: str = "auto"
    """'auto' (CUDA, then MPS, then CPU), 'cpu', 'cuda', 'cuda:N' or 'mps'."""
    precision: str = "auto"
    """'auto' (bf16 on CUDA ≥ 8.0, fp16 with a scaler on older cards, fp32 elsewhere), 'fp32', 'bf16', 'fp16'."""
    compile: bool | None = None
    """torch.compile the forward; None: on for CUDA, off elsewhere."""
    micro_batch_sequences: int | None = None
    """Sequences per forward/backward; None: probed on CUDA, the whole batch elsewhere."""
    max_memory_gib: float | None = None
    """Cap on the CUDA memory this peer may use, GiB (ignored elsewhere)."""
    peak_tflops: float | None = None
    """The card's dense bf16/fp16 peak in TFLOP/s, for MFU on cards the table does not know."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward (peer/train/device.py ``Placement.activation_checkpointing``)."""

    def __post_init__(self) -> None:
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"precision = {self.precision!r}: must be auto, fp32, bf16 or fp16")
        if self.micro_batch_sequences is not None and self.micro_batch_sequences < 1:
            raise ValueError(f"micro_batch_sequences = {self.micro_batch_sequences}: must be >= 1")
        if self.max_memory_gib is not None and not self.max_memory_gib > 0:
            raise ValueError(f"max_memory_gib = {self.max_memory_gib}: must be > 0 GiB")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops = {self.peak_tflops}: must be > 0 TFLOP/s")


@dataclass(frozen=True, kw_only=True)
class JoinConfig:
    """Everything `peer join` needs, resolved by the CLI from flags, environment and defaults."""

    initial_peers: tuple[str, ...] = ()
    run_id: str | None = None
    new_run: RunManifest | None = None
    """This peer's own manifest (--run/--preset/--algorithm): trained when the swarm announces it or
    no run, or when ``start_new_run``; None: the swarm's run (peer/run_choice.py)."""
    run_flag: str = "--run/--preset"
    """How the user named ``new_run`` (``--preset tiny``), for messages."""
    start_new_run: bool = False
    """--new-run: start ``new_run`` even while the swarm announces another run."""
    owner_key_path: Path | None = None
    """--owner-key: the Ed25519 key that signs a run this peer starts (protocol/signing.py), created
    0600 on first use; None: ``<data_dir>/owner.key``."""
    host: str = "0.0.0.0"
    """IPv4 address to listen on; the default, all interfaces (peer/reachability.py says whether others get through)."""
    port: int = 0
    announce: tuple[str, ...] = ()
    data_path: Path | None = None
    """--data: this peer's copy of the run's corpus, checked against ``data.corpus_sha256``
    (peer/train/data.py ``with_local_data``); None: the run's own ``data.path``."""
    data_cache_gb: float | None = None
    """--data-cache-gb: most GB of shard files of a sharded run on disk (peer/shards/store.py); None:
    ``peer.shards.corpus.DEFAULT_CACHE_GB``."""
    data_dir: Path
    client_mode: bool = False
    stage: int | None = None
    """--stage: the pipeline stage this peer serves in a run with ``pipeline.stages > 1``; None: the
    stage with the fewest live replicas (peer/pipeline/routing.py ``stage_to_serve``)."""
    uplink_mbps: float = 50.0
    """This peer's uplink in Mbit/s as assumed until its first sync measured it (the adaptive
    codec's byte budget). A per-peer fact: never part of the run manifest or its id."""
    max_upload_mbit: float | None = None
    """--max-upload-mbit: cap on what this peer sends, Mbit/s on the wire over any few seconds
    (peer/net/pacing.py); None: no cap."""
    max_gb_per_day: float | None = None
    """--max-gb-per-day: budget of GB (10⁹ bytes) sent plus received over any 24 h
    (peer/net/traffic.py); None: no budget."""
    threads: int | None = None
    manifest_wait_s: float = 20.0
    """How long to wait for the swarm to announce a run before giving up."""
    trainer: TrainerConfig = TrainerConfig()
    device: DeviceConfig = DeviceConfig()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port = {self.port}: must be in [0, 65535]")
        if not 0 < self.uplink_mbps <= 1e6:
            raise ValueError(f"uplink_mbps = {self.uplink_mbps}: must be in (0, 1e6] Mbit/s")
        for name, unit in (("max_upload_mbit", "Mbit/s"), ("max_gb_per_day", "GB")):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} = {value}: must be a finite number > 0 {unit} (or None: no cap)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads = {self.threads}: must be >= 1")
