"""The `bootstrap` command: run a bootstrap node for a locoswarm run.

Exit codes: 0 ok, 1 runtime failure, 2 usage or bad address, 69 initial peers unreachable,
75 its DHT process died (killed for memory, most often: start it again), 78 configuration error,
130 stopped by a signal (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path

import click

import protocol
from peer.net.cli_types import FiniteFloatRange
from peer.net.lifetime import (
    HelperWatch,
    StopOnSignal,
    dump_stacks_on_sigusr1,
    exit_process,
    quiet_handshakes_cut_by_a_dead_helper,
)
from peer.progress import Waiting
from protocol.errors import LocoError, exit_with
from protocol.manifest import load_manifest, sign_manifest
from protocol.presets import PRESETS
from protocol.signing import OWNER_KEY_FILE, load_owner_key


def default_identity() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("locoswarm")) / "bootstrap" / "identity.key"


@click.group(context_settings={"auto_envvar_prefix": "BOOTSTRAP", "help_option_names": ["-h", "--help"]})
@click.version_option(package_name="locoswarm")
def main() -> None:
    """Run a bootstrap node: the well-known entry into a locoswarm DHT."""
    dump_stacks_on_sigusr1()
    quiet_handshakes_cut_by_a_dead_helper()


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr)
    if not verbose:
        from peer.net.dht import quiet_hivemind_logs  # hivemind: imported once the first line is out

        quiet_hivemind_logs()


EXIT_INTERRUPTED = 130


def _still(log_format: str, what: str):
    """In text mode, a line every 4 s (a spinner on a terminal) while ``what`` lasts (peer/progress.py)."""
    return Waiting(what) if log_format == "text" else nullcontext()


@contextmanager
def _until_signal(what: str):
    """Yield an event that the first SIGINT/SIGTERM sets; on leaving, exit 130 if it was set.

    A second signal exits at once (130). Our errors end the command with their own exit code.
    """
    stop = threading.Event()
    try:
        with StopOnSignal(stop, f"stopping the {what} (signal again to exit now)"):
            yield stop
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    click.echo(f"{what} stopped", err=True)
    if stop.is_set():  # everything is released: skip the interpreter's teardown (peer/net/lifetime.py)
        exit_process(EXIT_INTERRUPTED)


@main.command()
@click.option("--host", default="0.0.0.0", show_default=True, help="Interface to listen on.")
@click.option(
    "--port",
    default=31337,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port of the DHT (open it in the firewall; 0 picks a free one).",
)
@click.option(
    "--announce",
    multiple=True,
    metavar="MULTIADDR",
    help="Public address to advertise, e.g. /ip4/203.0.113.7/tcp/31337 or "
    "/dns4/boot.example.org/tcp/31337 (repeatable). Needed behind NAT or port forwarding.",
)
@click.option(
    "--identity",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Private key file (created with mode 0600 on first start, reused after: the peer id and "
    "so the multiaddr stay the same). [default: the user data dir]/locoswarm/bootstrap/identity.key",
)
@click.option(
    "--owner-key",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Ed25519 key of the run's owner, which signs its announcement (created with mode 0600 on first "
    "start; the run id binds it, so keep it). A --run file that names an owner needs that owner's "
    "key. [default: owner.key beside the --identity file]",
)
@click.option(
    "--run",
    "run_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Run manifest (TOML) to announce. Default: the 'default' preset.",
)
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None, help="Announce a named preset.")
@click.option(
    "--run-id",
    default=None,
    metavar="RUN_ID",
    help="The run this node announces as its own (signed by its identity): a plain `peer join` that dials "
    "it trains that run, whatever other runs strangers announce. With --run/--preset it must be their run "
    "id; alone, the node serves a run its peers announce (e.g. one `peer swarm` or `peer join --new-run` "
    "started) and announces no manifest. [default: the announced run's]",
)
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR", help="Other nodes to link with.")
@click.option(
    "--relay/--no-relay",
    default=True,
    show_default=True,
    help="Serve as a libp2p circuit relay so peers behind NAT can be reached through this node.",
)
@click.option(
    "--monitor-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve the swarm monitor (web page, /api/swarm JSON, /metrics, /healthz) on this HTTP "
    "port (0: any free port). Default: no monitor.",
)
@click.option(
    "--monitor-host",
    default="127.0.0.1",
    show_default=True,
    help="Interface of the monitor's HTTP server (0.0.0.0: all).",
)
@click.option(
    "--monitor-poll",
    type=FiniteFloatRange(0.1),
    default=1.0,
    show_default=True,
    help="Seconds between two reads of the peers' progress records.",
)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def run(
    host,
    port,
    announce,
    identity,
    owner_key,
    run_file,
    preset,
    run_id,
    initial_peers,
    relay,
    monitor_port,
    monitor_host,
    monitor_poll,
    log_format,
    verbose,
) -> None:
    """Start the node, print its multiaddrs, announce the run; Ctrl-C or SIGTERM stops it (exit 130).

    The node is the swarm's well-known entry: peers pass one of the printed multiaddrs to
    `peer join --initial-peers`. Open TCP PORT in the firewall (and forward it on a NAT router);
    the monitor port only if you want others to see the page.

    \b
    Examples:
      bootstrap run                                   # default run, port 31337
      bootstrap run --run my_run.toml --announce /ip4/203.0.113.7/tcp/31337
      bootstrap run --identity /var/lib/locoswarm/boot.key --monitor-port 8080 --monitor-host 0.0.0.0
      bootstrap run --port 0 --identity ./boot.key --preset tiny --no-relay
      bootstrap run --run my_run.toml --owner-key ~/keys/my_run.owner.key
    \b
    Check from another machine that the node is reachable:
      peer status --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/QmThePrintedId
    """
    if log_format == "text":  # the first line, before hivemind's import (seconds on a busy machine)
        click.echo(f"locoswarm {protocol.__version__} bootstrap node: loading hivemind")
    with _still(log_format, "loading hivemind"):
        from bootstrap.node import BootstrapConfig, serve

        _configure_logging(verbose)
    with _until_signal("bootstrap node") as stop:
        try:
            if run_file is not None and preset is not None:
                raise click.UsageError("give either --run FILE.toml or --preset NAME, not both")
            if run_id is not None and not (0 < len(run_id) <= 64 and all(c in "0123456789abcdef" for c in run_id)):
                raise click.BadParameter(
                    f"{run_id!r} is not a run id (lowercase hex, as `peer status` prints it)", param_hint="--run-id"
                )
            identity = identity or default_identity()
            owner = signed = manifest = None
            if run_id is None or run_file is not None or preset is not None:
                draft = load_manifest(run_file) if run_file else PRESETS[preset or "default"]()
                owner = load_owner_key(owner_key or identity.with_name(OWNER_KEY_FILE))
                signed = sign_manifest(draft, owner)  # ManifestError: the file names another owner
                manifest = signed.manifest
                if run_id is not None and run_id != signed.run_id:
                    raise click.BadParameter(
                        f"{run_id} is not the run id of the announced run ({signed.run_id}); drop --run-id, "
                        "or drop --run/--preset to serve that run without announcing a manifest",
                        param_hint="--run-id",
                    )
            cfg = BootstrapConfig(
                host=host,
                port=port,
                announce=tuple(announce),
                identity_path=identity,
                initial_peers=tuple(initial_peers),
                manifest=signed,
                home_run_id=run_id,
                relay=relay,
                monitor_host=monitor_host,
                monitor_port=monitor_port,
                monitor_poll_s=monitor_poll,
            )

            def on_ready(maddrs: list[str], monitor_url: str | None) -> None:
                if log_format == "json":
                    click.echo(
                        json.dumps(
                            {
                                "event": "ready",
                                "maddrs": maddrs,
                                "run_id": manifest.run_id if manifest else run_id,
                                "run_name": manifest.name if manifest else None,
                                "owner": manifest.owner if manifest else None,
                                "version": protocol.__version__,
                                "relay": relay,
                                "monitor_url": monitor_url,
                            }
                        )
                    )
                else:
                    what = f"{manifest.run_id} ({manifest.name})" if manifest else f"{run_id} (announced by its peers)"
                    click.echo(
                        f"locoswarm {protocol.__version__} bootstrap node | run {what} | relay {'on' if relay else 'off'}"
                    )
                    if manifest and owner:
                        click.echo(f"run owner {manifest.owner} (key {owner.path})")
                    click.echo("peers join with:")
                    for maddr in maddrs:
                        click.echo(f"  peer join --initial-peers {maddr}")
                    if monitor_url:
                        click.echo(
                            f"swarm monitor: {monitor_url} (JSON: {monitor_url}api/swarm, "
                            f"Prometheus: {monitor_url}metrics)"
                        )
                sys.stdout.flush()

            if log_format == "text":  # starting p2pd and the DHT takes seconds: say so first (no silent wait)
                click.echo(
                    f"locoswarm {protocol.__version__} bootstrap node: starting the DHT on "
                    + (f"{host}:{port}" if port else f"{host}, any free port")
                    + (f", linking with {len(initial_peers)} node(s)" if initial_peers else "")
                )
                sys.stdout.flush()
            serve(cfg, stop, on_ready)
        except LocoError as exc:
            exit_with(exc, verbose=verbose)


@main.command()
@click.option(
    "--initial-peers",
    multiple=True,
    required=True,
    metavar="MULTIADDR",
    help="Address of any live node of the swarm (repeatable).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface of the HTTP server (0.0.0.0: all).")
@click.option(
    "--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="HTTP port (0: any free port)."
)
@click.option(
    "--poll",
    type=FiniteFloatRange(0.1),
    default=1.0,
    show_default=True,
    help="Seconds between two reads of the peers' progress records.",
)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def monitor(initial_peers, host, port, poll, log_format, verbose) -> None:
    """Serve the swarm monitor for any swarm, from a client-mode DHT node (no bootstrap needed).

    Pages: / (live peers, rounds, validation loss over time, tok/s, bytes, group sizes, last seen),
    /api/swarm (the same as JSON), /metrics (Prometheus), /healthz.

    \b
    Examples:
      bootstrap monitor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/QmBootstrapId
      bootstrap monitor --initial-peers /dns4/boot.example.org/tcp/31337/p2p/QmId --host 0.0.0.0 --port 9100
    """
    if log_format == "text":  # no silent wait while hivemind loads, p2pd starts and dials the swarm
        click.echo(
            f"locoswarm {protocol.__version__} swarm monitor: connecting to {len(initial_peers)} node(s) of the swarm"
        )
    with _still(log_format, "loading hivemind"):
        from bootstrap.monitor import MonitorConfig, run_monitor
        from peer.net import dht_node

        _configure_logging(verbose)
    with _until_signal("monitor") as stop:
        try:
            with _still(log_format, "connecting to the swarm"):
                dht = dht_node.start_dht(initial_peers=initial_peers, client_mode=True)
            watch = HelperWatch(stop, "run the monitor again").watch_dht("monitor's", dht).start()
            try:

                def on_ready(url: str) -> None:
                    if log_format == "json":
                        click.echo(json.dumps({"event": "ready", "monitor_url": url, "version": protocol.__version__}))
                    else:
                        click.echo(
                            f"locoswarm {protocol.__version__} swarm monitor: {url} "
                            f"(JSON: {url}api/swarm, Prometheus: {url}metrics)"
                        )
                    sys.stdout.flush()

                run_monitor(
                    dht, host=host, port=port, config=MonitorConfig(poll_interval_s=poll), stop=stop, on_ready=on_ready
                )
                watch.raise_if_died()
            finally:
                watch.stop()
                dht.shutdown()
        except LocoError as exc:
            exit_with(exc, verbose=verbose)


if __name__ == "__main__":
    main()
