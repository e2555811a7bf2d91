"""What the `peer` commands share: the data directory, logging, and the run a command names
(``--run FILE`` or ``--preset NAME``)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

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
