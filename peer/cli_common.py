"""What the `peer` commands share: the data directory, logging, and the run a command names
(``--run FILE`` or ``--preset NAME``)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from peer.net.cli_types import FiniteFloatRange
from protocol.manifest import RunManifest, load_manifest
from protocol.presets import PRESETS

logger = logging.getLogger("peer")


def default_data_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("locoswarm")) / "peer"


def configure_logging(verbose: bool) -> None:
    """Logging to stderr (debug with ``verbose``), hivemind's own logs quieted. It imports hivemind
    (and torch: seconds): call it after a command's first line, never at import (issue #68)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        from peer.net.dht import quiet_hivemind_logs

        quiet_hivemind_logs()


ALGORITHMS = ("diloco", "noloco", "independent")


def device_options(*, lists: bool = True):
    """The device options ``peer join`` and ``peer doctor`` share, in this order: ``--device``,
    ``--precision``, ``--micro-batch``, ``--max-memory``, ``--compile/--no-compile``,
    ``--peak-tflops``, ``--activation-checkpointing`` (parameters ``device``, ``precision``,
    ``micro_batch``, ``max_memory``, ``compile_``, ``peak_tflops``, ``activation_checkpointing``),
    as peer/train/device.py ``place`` reads them; ``lists``: ``--device`` takes a list of cards."""
    options = [
        click.option(
            "--device",
            default="auto",
            show_default=True,
            metavar="auto|cpu|cuda|cuda:N|mps" + ("|LIST" if lists else ""),
            help="Where to train: auto picks CUDA, then Apple MPS, then the CPU (one card)."
            + (" A list (cuda:0,cuda:1) or cuda:all trains data-parallel on those cards as one peer." if lists else ""),
        ),
        click.option(
            "--precision",
            type=click.Choice(["auto", "fp32", "bf16", "fp16"]),
            default="auto",
            show_default=True,
            help="auto: bf16 on CUDA compute capability >= 8.0, fp16 with a gradient scaler on older cards, "
            "fp32 on CPU/MPS. Master weights and φ stay fp32.",
        ),
        click.option(
            "--micro-batch",
            "micro_batch",
            type=click.IntRange(1),
            default=None,
            help="Sequences per forward/backward (gradient accumulation reaches the run's batch). "
            "Default: the largest that fits on CUDA, the whole batch elsewhere.",
        ),
        click.option(
            "--max-memory",
            "max_memory",
            type=FiniteFloatRange(0, min_open=True),
            default=None,
            metavar="GIB",
            help="Cap on the GPU memory this peer may use, in GiB (CUDA only).",
        ),
        click.option(
            "--compile/--no-compile",
            "compile_",
            default=None,
            help="torch.compile the model. [default: on for CUDA, off for CPU]",
        ),
        click.option(
            "--peak-tflops",
            type=FiniteFloatRange(0, min_open=True),
            default=None,
            help="The card's dense bf16/fp16 peak in TFLOP/s, for MFU on cards the built-in table lacks.",
        ),
        click.option(
            "--activation-checkpointing",
            "activation_checkpointing",
            is_flag=True,
            help="Recompute activations in the backward instead of keeping them: a larger micro-batch fits "
            "(computed: llama-350m fits an 8 GiB card only with it; llama-1b needs a 24 GiB card either way) "
            "for about a third more compute per step.",
        ),
    ]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def resolve_run(run_file: Path | None, preset: str | None, algorithm: str | None = None) -> RunManifest | None:
    if run_file is not None and preset is not None:
        raise click.UsageError("give either --run FILE.toml or --preset NAME, not both")
    manifest = None
    if run_file is not None:
        manifest = load_manifest(run_file)
    elif preset is not None or algorithm is not None:
        manifest = PRESETS[preset or "default"]()
    if manifest is not None and algorithm is not None:
        manifest = manifest.replace(sync={"algorithm": algorithm})
    return manifest
