"""The `bootstrap` command: run a bootstrap node for a locoswarm run."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path

import click

import protocol
from protocol.errors import LocoError
from protocol.manifest import load_manifest
from protocol.presets import PRESETS


def default_identity() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("locoswarm")) / "bootstrap" / "identity.key"


@click.group(context_settings={"auto_envvar_prefix": "BOOTSTRAP", "help_option_names": ["-h", "--help"]})
@click.version_option(package_name="locoswarm")
def main() -> None:
    """Run a bootstrap node: the well-known entry into a locoswarm DHT."""


@main.command()
@click.option("--host", default="0.0.0.0", show_default=True, help="Interface to listen on.")
@click.option("--port", default=31337, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0 picks a free one).")
@click.option("--announce", multiple=True, metavar="MULTIADDR",
              help="Public address to advertise, e.g. /ip4/203.0.113.7/tcp/31337 (repeatable).")
@click.option("--identity", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Private key file (created with mode 0600 on first start). "
                   "[default: the user data dir]/locoswarm/bootstrap/identity.key")
@click.option("--run", "run_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Run manifest (TOML) to announce. Default: the 'default' preset.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None, help="Announce a named preset.")
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR", help="Other nodes to link with.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def run(host, port, announce, identity, run_file, preset, initial_peers, log_format, verbose) -> None:
    """Start the node, print its multiaddrs, announce the run; stop cleanly on Ctrl-C or SIGTERM.

    \b
    Examples:
      bootstrap run                                   # default run, port 31337
      bootstrap run --run my_run.toml --announce /ip4/203.0.113.7/tcp/31337
      bootstrap run --port 0 --identity ./boot.key --preset tiny
    """
    from bootstrap.node import BootstrapConfig, serve

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr)
    if not verbose:
        from protocol.dht import quiet_hivemind_logs

        quiet_hivemind_logs()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if run_file is not None and preset is not None:
            raise click.UsageError("give either --run FILE.toml or --preset NAME, not both")
        manifest = load_manifest(run_file) if run_file else PRESETS[preset or "default"]()
        cfg = BootstrapConfig(host=host, port=port, announce=tuple(announce),
                              identity_path=identity or default_identity(), initial_peers=tuple(initial_peers),
                              manifest=manifest)

        def on_ready(maddrs: list[str]) -> None:
            if log_format == "json":
                click.echo(json.dumps({"event": "ready", "maddrs": maddrs, "run_id": manifest.run_id,
                                       "run_name": manifest.name, "version": protocol.__version__}))
            else:
                click.echo(f"locoswarm {protocol.__version__} bootstrap node | run {manifest.run_id} ({manifest.name})")
                click.echo("peers join with:")
                for maddr in maddrs:
                    click.echo(f"  peer join --initial-peers {maddr}")
            sys.stdout.flush()

        serve(cfg, stop, on_ready)
    except LocoError as exc:
        if verbose:
            logging.exception("failed")
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    click.echo("bootstrap node stopped", err=True)


if __name__ == "__main__":
    main()
