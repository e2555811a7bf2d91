"""The `peer` command: join a swarm, start a local one, check this machine, or prepare a run's data.

Precedence of settings: flag > environment (PEER_<COMMAND>_<FLAG>, e.g. PEER_JOIN_INITIAL_PEERS)
> default. Exit codes: 0 ok, 1 runtime failure, 2 usage or bad address, 64 no single run to join
(several announced, or --run/--preset differs from the swarm's run), 69 bootstrap unreachable,
78 configuration error, 130 interrupted.

Only every command's flags and their help text are declared here (click); the work is in
peer/node.py, peer/swarm.py, peer/status.py and peer/doctor.py.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from peer.cli_common import ALGORITHMS, configure_logging, default_data_dir, device_options, resolve_run
from peer.cli_tools import data_group, doctor, status
from peer.config import DeviceConfig, JoinConfig, TrainerConfig
from peer.net import pacing
from peer.net.cli_types import FiniteFloatRange
from peer.net.lifetime import dump_stacks_on_sigusr1, exit_process, quiet_handshakes_cut_by_a_dead_helper
from peer.reporting import Reporter
from peer.swarm import SwarmConfig, check_data_path, run_swarm
from protocol.errors import LocoError, exit_with
from protocol.presets import PRESETS

logger = logging.getLogger("peer")


@click.group(context_settings={"auto_envvar_prefix": "PEER", "help_option_names": ["-h", "--help"]})
@click.version_option(package_name="locoswarm")
def main() -> None:
    """Train a shared language model with other peers (DiLoCo over a DHT)."""
    dump_stacks_on_sigusr1()
    quiet_handshakes_cut_by_a_dead_helper()


@main.command()
@click.option(
    "--initial-peers",
    multiple=True,
    metavar="MULTIADDR",
    help="Address of any live node of the swarm (repeatable). None: start a new swarm.",
)
@click.option("--run-id", default=None, help="Run to join when the swarm announces several.")
@click.option(
    "--run",
    "run_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Train this run manifest (TOML): the swarm's run, or a new swarm's. "
    "Another run than the swarm's only with --new-run.",
)
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    default=None,
    help="Train a named preset run, as --run (with no --initial-peers: 'default').",
)
@click.option(
    "--algorithm",
    type=click.Choice(ALGORITHMS),
    default=None,
    help="Sync algorithm of this peer's run (overrides the manifest's sync.algorithm).",
)
@click.option(
    "--new-run", is_flag=True, help="Start the --run/--preset run even though the swarm announces another one."
)
@click.option(
    "--owner-key",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Ed25519 key that signs a run this peer starts (a new swarm, or --new-run); created with mode "
    "0600 on first use. The run id binds it: keep it to restart the run. [default: DATA_DIR/owner.key]",
)
@click.option(
    "--host",
    default="0.0.0.0",
    show_default=True,
    help="IPv4 address to listen on (0.0.0.0: all interfaces; 127.0.0.1: this machine only).",
)
@click.option(
    "--port",
    default=0,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port; 0 picks one (forward a fixed port on a NAT router to be reachable).",
)
@click.option(
    "--announce",
    multiple=True,
    metavar="MULTIADDR",
    help="Address others can dial, e.g. /ip4/203.0.113.7/tcp/31337 behind a forwarded port "
    "(repeatable): advertised and printed first.",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(path_type=Path),
    default=None,
    metavar="PATH",
    help="Your copy of the run's corpus (file or directory), checked against the run's "
    "data.corpus_sha256 before training; for a sharded run, a directory of its shards (each hash-checked).",
)
@click.option(
    "--data-cache-gb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="A sharded run: most GB of shard files kept on disk (consumed shards are evicted). [default: 20]",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Identity and checkpoints. [default: the user data dir]/locoswarm/peer",
)
@click.option(
    "--max-rounds",
    type=click.IntRange(0),
    default=None,
    help="Stop once the run reaches this round (outer step). Default: train until Ctrl-C.",
)
@click.option(
    "--eval-every",
    type=click.IntRange(0),
    default=5,
    show_default=True,
    help="Every K rounds one live peer of the swarm (the same choice on every peer) evaluates φ "
    "and publishes the validation loss (0: each peer at its start and end only).",
)
@click.option(
    "--export-phi-every",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Write φ as safetensors beside the checkpoint every K rounds (0: never).",
)
@click.option(
    "--checkpoint-every",
    "checkpoint_every",
    type=FiniteFloatRange(0, 1e9),
    default=None,
    metavar="SECONDS",
    help="Write the checkpoint at most every SECONDS (0: every round). It holds φ, the outer state, θ and "
    "AdamW's moments (2.5 GB at ~125M parameters). Default: sized to the model, every round while "
    "the checkpoint is under 256 MiB (the default and tiny presets), else at most every 600 s. "
    "Ctrl-C always writes one; a crash loses at most SECONDS of rounds, caught up from the swarm.",
)
@click.option("--threads", type=click.IntRange(1), default=None, help="CPU threads for torch.")
@click.option(
    "--wait-for-peers",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Before the first round, wait (up to 120 s) until this many peers are live.",
)
@click.option("--client-mode", is_flag=True, help="Do not accept incoming connections (behind NAT).")
@click.option(
    "--stage",
    type=click.IntRange(0),
    default=None,
    help="In a run with [pipeline] stages > 1: the stage this peer serves. "
    "Default: the stage with the fewest live replicas (stage 0 in --client-mode).",
)
@click.option(
    "--uplink-mbps",
    type=FiniteFloatRange(0, 1e6, min_open=True),
    default=50.0,
    show_default=True,
    help="This peer's uplink in Mbit/s, assumed until its first sync measures it (adaptive codec budget).",
)
@click.option(
    "--max-upload-mbit",
    type=FiniteFloatRange(0, 1e6, min_open=True),
    default=None,
    metavar="MBIT",
    help="Cap on what this peer sends, in Mbit/s on the wire, over any few seconds (all-reduce, "
    "state and shard serving share it), e.g. 5 on a shared line. Default: no cap.",
)
@click.option(
    "--max-gb-per-day",
    type=FiniteFloatRange(0, 1e6, min_open=True),
    default=None,
    metavar="GB",
    help="Budget of GB (10^9 bytes) sent plus received over any 24 h, kept in DATA_DIR/traffic.json "
    "across restarts: past the budget's pro-rata share the peer sits out syncs (it keeps training). "
    "Default: no budget.",
)
@device_options()
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one event per line on stdout, for programs.",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def join(
    initial_peers,
    run_id,
    run_file,
    preset,
    algorithm,
    new_run,
    owner_key,
    host,
    port,
    announce,
    data_path,
    data_cache_gb,
    data_dir,
    max_rounds,
    eval_every,
    export_phi_every,
    checkpoint_every,
    threads,
    wait_for_peers,
    client_mode,
    stage,
    uplink_mbps,
    max_upload_mbit,
    max_gb_per_day,
    device,
    precision,
    micro_batch,
    max_memory,
    compile_,
    peak_tflops,
    activation_checkpointing,
    log_format,
    verbose,
) -> None:
    """Join a swarm and train until stopped (Ctrl-C finishes the step, checkpoints, exits 130).

    \b
    Examples:
      peer join                                  # start a new swarm on the default run
      peer join --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/Qm...
      peer join --run my_run.toml --max-rounds 50
      peer join --initial-peers ADDR --run-id 3f2a...   # the swarm announces several runs
      peer join --initial-peers ADDR --preset tiny --new-run   # a second run beside the swarm's
      peer join --device cuda:1 --max-memory 8   # second GPU, at most 8 GiB of it
      peer join --device cuda:0,cuda:1           # both GPUs of this box, one peer of the swarm
      peer join --initial-peers ADDR --data ~/corpus   # the run names its corpus by hash; here is my copy
      peer join --port 31337 --announce /ip4/203.0.113.7/tcp/31337   # behind a forwarded port
      peer join --initial-peers ADDR --max-upload-mbit 5 --max-gb-per-day 2   # a metered line
    """
    import threading

    # on a terminal, a round's inner steps also draw one transient line (peer/reporting.py)
    reporter = Reporter(log_format, live_steps=True)
    reporter.emit("status", message="peer join: loading torch and hivemind")
    configure_logging(verbose)  # after the first line: it imports hivemind (seconds)
    from peer.node import StopOnSignal, join as run_join

    try:
        local_run = resolve_run(run_file, preset, algorithm)
        if new_run and local_run is None:
            raise click.UsageError("--new-run needs the run to start: --run FILE.toml or --preset NAME")
        run_flag = (
            f"--run {run_file}"
            if run_file is not None
            else f"--preset {preset}"
            if preset is not None
            else f"--algorithm {algorithm}"
        )
        cfg = JoinConfig(
            initial_peers=tuple(initial_peers),
            run_id=run_id,
            new_run=local_run,
            run_flag=run_flag,
            start_new_run=new_run,
            owner_key_path=owner_key,
            host=host,
            port=port,
            announce=tuple(announce),
            data_path=data_path,
            data_cache_gb=data_cache_gb,
            data_dir=data_dir or default_data_dir(),
            client_mode=client_mode,
            stage=stage,
            uplink_mbps=uplink_mbps,
            max_upload_mbit=max_upload_mbit,
            max_gb_per_day=max_gb_per_day,
            threads=threads,
            trainer=TrainerConfig(
                max_rounds=max_rounds,
                eval_every_rounds=eval_every,
                wait_for_peers=wait_for_peers,
                export_phi_every_rounds=export_phi_every,
                checkpoint_every_s=checkpoint_every,
            ),
            device=DeviceConfig(
                device=device,
                precision=precision,
                compile=compile_,
                micro_batch_sequences=micro_batch,
                max_memory_gib=max_memory,
                peak_tflops=peak_tflops,
                activation_checkpointing=activation_checkpointing,
            ),
        )
        if cfg.max_upload_mbit is not None or cfg.max_gb_per_day is not None:
            pacing.install(cfg.max_upload_mbit)  # before the DHT and averager processes fork: they share it
        stop = threading.Event()
        with StopOnSignal(stop):
            code, _ = run_join(cfg, reporter, stop)
    except LocoError as exc:
        exit_with(exc, verbose=verbose)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    exit_process(code)  # everything is released: skip the interpreter's seconds-long teardown


@main.command()
@click.option(
    "--peers", "num_peers", type=click.IntRange(1, 64), default=3, show_default=True, help="Peer processes to start."
)
@click.option("--rounds", type=click.IntRange(1), default=10, show_default=True, help="Rounds (outer steps) to train.")
@click.option(
    "--run",
    "run_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Run manifest (TOML). Default: the 'default' preset.",
)
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None, help="Named run preset.")
@click.option(
    "--algorithm",
    type=click.Choice(ALGORITHMS),
    default=None,
    help="Sync algorithm (overrides the manifest's sync.algorithm).",
)
@click.option(
    "--eval-every",
    type=click.IntRange(0),
    default=5,
    show_default=True,
    help="Every K rounds one peer evaluates φ (0: each peer at its start and end only).",
)
@click.option(
    "--summary",
    "summary_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the summary as JSON to this file.",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where peers keep identities, checkpoints and logs. Default: a temporary directory, "
    "removed at the end unless --keep or a peer failed.",
)
@click.option("--keep", is_flag=True, help="Keep the temporary directory (logs, checkpoints) at the end.")
@click.option(
    "--device",
    default="auto",
    show_default=True,
    metavar="auto|cpu|cuda|cuda:N|mps",
    help="Where every peer trains (they share it).",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(path_type=Path),
    default=None,
    metavar="PATH",
    help="Train on this corpus (file or directory of text, .jsonl or .parquet): every peer reads it "
    "(peer join --data PATH); the run is announced by its content hash, never by the path. "
    "Default: the run's data.path, or the Python standard library.",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def swarm(
    num_peers, rounds, run_file, preset, algorithm, eval_every, summary_file, workdir, keep, device, data_path, verbose
) -> None:
    """Start a bootstrap node and N peers on 127.0.0.1, train, and print a summary.

    \b
    Examples:
      peer swarm                                  # 3 peers, 10 rounds of the default run
      peer swarm --peers 4 --rounds 20 --summary out.json
      peer swarm --preset tiny --rounds 3
      peer swarm --algorithm noloco --peers 4
      peer swarm --device cpu                     # keep a GPU free
      peer swarm --keep                           # keep logs and checkpoints in /tmp
      peer swarm --run my_run.toml --data ~/corpus   # train on a corpus of this machine
    """
    click.echo("local swarm: loading torch and hivemind")  # the first line, before the imports (issue #68)
    from peer.train.device import resolve_device

    configure_logging(verbose)
    try:
        check_data_path(data_path)  # one line naming it, exit 78, before anything starts
        resolve_device(device)  # one error line here rather than one per peer
        manifest = resolve_run(run_file, preset, algorithm) or PRESETS["default"]()
        cfg = SwarmConfig(
            num_peers=num_peers,
            rounds=rounds,
            manifest=manifest,
            eval_every_rounds=eval_every,
            summary_path=summary_file,
            workdir=workdir,
            keep=keep,
            device=device,
            data_path=data_path,
        )
        code = run_swarm(cfg)
    except LocoError as exc:
        exit_with(exc, verbose=verbose)
    sys.exit(code)


main.add_command(status)
main.add_command(doctor)
main.add_command(data_group)


if __name__ == "__main__":
    main()
