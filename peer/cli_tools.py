"""The `peer` commands that look rather than train: `peer status`, `peer doctor` and `peer data
prepare` (registered on the `peer` group in peer/cli.py; the work is in peer/status.py,
peer/doctor.py and peer/train/data.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from peer.cli_common import configure_logging, default_data_dir, device_options, resolve_run
from peer.net.cli_types import FiniteFloatRange
from peer.net.lifetime import exit_process
from peer.run_choice import checkpointed_runs
from peer.shards.build import HUB_PREFIX, PrepareConfig, prepare_source
from peer.shards.prepare import prepare_shards
from peer.train.bpe import train_for_run
from peer.train.cache import default_cache_dir
from peer.train.sources import describe, iter_documents
from protocol.errors import LocoError, exit_with
from protocol.presets import PRESETS


@click.command()
@click.option(
    "--initial-peers",
    multiple=True,
    required=True,
    metavar="MULTIADDR",
    help="Address of any live node of the swarm (repeatable).",
)
@click.option("--run-id", default=None, help="Show only this run. Default: every run the swarm announces.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option(
    "--wait",
    "wait_s",
    type=FiniteFloatRange(0),
    default=5.0,
    show_default=True,
    help="Seconds to keep looking while no progress record is found.",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def status(initial_peers, run_id, as_json, wait_s, verbose) -> None:
    """Print the swarm's live peers: rounds, losses, throughput, groups, bytes. Does not train.

    Joins the DHT as a client (accepts no connections), reads the progress records, leaves.
    Exits 69 when no initial peer answers: a quick check that a bootstrap node is reachable.

    \b
    Examples:
      peer status --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/QmBootstrapId
      peer status --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/QmId --json | jq '.runs[0].peers[].round'
    """
    import json

    print("peer status: loading hivemind", file=sys.stderr, flush=True)  # the first line, before the imports
    from peer.status import print_status, status as read_status, status_console

    configure_logging(verbose)
    try:
        result = read_status(tuple(initial_peers), run_id, wait_s=wait_s, stream=sys.stderr)
    except LocoError as exc:
        exit_with(exc, verbose=verbose)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        print_status(result, status_console())
    exit_process(0)  # its DHT node is shut down: skip the interpreter's seconds-long teardown (issue #68)


@click.command()
@click.option(
    "--run",
    "run_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Run manifest (TOML) whose model to try.",
)
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    default=None,
    help="Named run preset instead of --run. Neither: 'default'.",
)
@device_options(lists=False)
@click.option(
    "--steps",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="Timed inner steps (after one untimed warm-up step).",
)
@click.option(
    "--initial-peers",
    multiple=True,
    metavar="MULTIADDR",
    help="Also check that one of these swarm nodes answers (repeatable), as peer join would dial them.",
)
@click.option("--run-id", default=None, help="With --initial-peers: the run to check when the swarm announces several.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="TCP port to check dialability on: the one peer join will listen on (0: any free port).",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="With --initial-peers: peer join's data dir, whose checkpoints pick one of several runs as "
    "peer join does. [default: the user data dir]/locoswarm/peer",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def doctor(
    run_file,
    preset,
    device,
    precision,
    micro_batch,
    max_memory,
    compile_,
    peak_tflops,
    activation_checkpointing,
    steps,
    initial_peers,
    run_id,
    port,
    data_dir,
    as_json,
    verbose,
) -> None:
    """Check this machine before joining: device, memory, precision, the micro-batch that fits the
    run's model, tokens/s over a few real inner steps, versions; with --initial-peers, whether the
    swarm answers, whether it can dial this machine back on --port, the measured uplink, and the
    model of the run the swarm announces (chosen as peer join chooses: --run/--preset, --run-id,
    checkpoints in --data-dir), rather than the local --run/--preset or the default.

    Exits 0 when this peer can contribute, 78 when it cannot, 69 when only the swarm did not
    answer (each problem says what to do).

    \b
    Examples:
      peer doctor                                # the default run on the best device
      peer doctor --preset llama-125m --max-memory 10
      peer doctor --preset llama-125m --device cpu --micro-batch 1
      peer doctor --run my_run.toml --device cuda:1 --json
      peer doctor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/Qm...
    """
    import json

    print("peer doctor: loading torch", file=sys.stderr, flush=True)  # the first line, before the import
    from peer.doctor import Checks, DoctorReport, check_swarm, diagnose, render

    checks = Checks(sys.stderr)  # each check as it starts; stdout carries the report (or its JSON)
    configure_logging(verbose)
    try:
        local = resolve_run(run_file, preset)
    except LocoError as exc:
        exit_with(exc, verbose=verbose)
    manifest = local or PRESETS["default"]()
    report = DoctorReport()
    if initial_peers:  # first: the DHT forks before CUDA is touched
        flag = f"--run {run_file}" if run_file is not None else f"--preset {preset}"
        run = check_swarm(
            report,
            initial_peers,
            port=port,
            local=local,
            local_flag=flag,
            run_id=run_id,
            checkpoints=checkpointed_runs(data_dir or default_data_dir()),
            checks=checks,
        )
        manifest = run or manifest
    report = diagnose(
        manifest,
        device=device,
        precision=precision,
        compile=compile_,
        micro_batch_sequences=micro_batch,
        max_memory_gib=max_memory,
        peak_tflops=peak_tflops,
        activation_checkpointing=activation_checkpointing,
        steps=steps,
        report=report,
        checks=checks,
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    **report.facts,
                    "problems": [*report.network_problems, *report.problems],
                    "can_contribute": report.can_contribute,
                },
                indent=2,
            )
        )
    else:
        for line in render(report):
            click.echo(line)
    exit_process(report.exit_code)  # skip the interpreter's seconds-long teardown of torch and the model


@click.group("data")
def data_group() -> None:
    """Prepare a run's corpus and tokenizer before training."""


@data_group.command()
@click.argument("source", required=False, metavar="[SOURCE]")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="With SOURCE or --hub: the directory the shards and shards.json go to (new, empty, or an earlier --out).",
)
@click.option(
    "--shard-mb",
    type=click.FloatRange(0.001, 1024),
    default=64.0,
    show_default=True,
    help="With SOURCE: MB of text per shard (a parquet shard is about a third of that on disk).",
)
@click.option(
    "--format",
    "shard_format",
    type=click.Choice(["parquet", "jsonl"]),
    default="parquet",
    show_default=True,
    help="With SOURCE: the shards' file format (one 'text' column or field).",
)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    help="With SOURCE: the field of its .jsonl/.parquet records that holds the text.",
)
@click.option(
    "--hub",
    default="",
    metavar="OWNER/NAME",
    help="A Hub dataset to cut into shards: as SOURCE hf://datasets/OWNER/NAME.",
)
@click.option(
    "--include",
    multiple=True,
    metavar="GLOB",
    help="With a Hub dataset: its files to read (repeatable). [default: its .jsonl/.parquet files, else its text files]",
)
@click.option(
    "--run",
    "run_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Run manifest (TOML) whose [data] section to prepare.",
)
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    default=None,
    help="Named run preset instead of --run. Neither: 'default'.",
)
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Token cache directory. [default: $LOCOSWARM_CACHE_DIR, else the user cache dir]/locoswarm; "
    "peers on this machine read the same one",
)
@click.option(
    "--shards",
    "shards_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="A directory of .parquet/.jsonl shard files already cut: hash each as it is, write DIR/shards.json and "
    "print the [data] section of a sharded run (with --hub-repo: where shards.json goes).",
)
@click.option(
    "--base-url", default="", help="With SOURCE or --shards: the HTTP(S) URL the shards will be served under."
)
@click.option(
    "--hub-repo", default="", help="A Hugging Face dataset repository (owner/name) of shards to list as they are."
)
@click.option(
    "--hub-revision",
    default="",
    help="With --hub-repo: the commit to pin (40 hex digits); with --hub: a branch, tag or commit. [default: main]",
)
@click.option("--validation-shards", type=click.IntRange(min=1), default=1, show_default=True, help="Shards held out.")
@click.option(
    "--train-tokenizer",
    "train_tokenizer",
    type=click.IntRange(512, 1 << 20),
    default=None,
    metavar="N",
    help="First train an N-id byte-level BPE on the corpus's training split (once, here: peers never train "
    "one), keep its tokenizer.json in the cache's tokenizers/ store, and print the [data] lines naming it by hash.",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logs and tracebacks.")
def prepare(
    source,
    out_dir,
    shard_mb,
    shard_format,
    text_field,
    hub,
    include,
    run_file,
    preset,
    cache_dir,
    shards_dir,
    base_url,
    hub_repo,
    hub_revision,
    validation_shards,
    train_tokenizer,
    verbose,
) -> None:
    """Cut your own text into a run's hashed shards; or tokenize a run's corpus into the token cache
    (training its BPE first if it uses one) and print its hashes, as TOML for the manifest's [data].

    SOURCE (with --out) is a directory tree of text files (.txt, .md, .rst, .html stripped to its
    text, source code: each file one document; binary files skipped and counted), a directory of
    .jsonl/.parquet records with a text field, or a Hugging Face dataset hf://datasets/OWNER/NAME[@REV]
    (downloaded with your token from HF_TOKEN or `hf auth login`, resumable, into the Hub's cache;
    the commit is pinned in OUT/prepared.json). The shards (part-00000.parquet ...) and their list
    OUT/shards.json are what `peer swarm --data OUT` and a run's [data] section (printed) take.

    Without SOURCE: --shards/--hub-repo list shards already cut; else the run's corpus is tokenized
    and a later `peer join` on this machine reuses the cache (with --cache-dir, set
    LOCOSWARM_CACHE_DIR to the same directory for it).

    \b
    Examples:
      peer data prepare ~/notes --out ~/shards                      # a tree of text files
      peer data prepare ~/exports/jsonl --out ~/shards --shard-mb 128 --text-field content
      peer data prepare hf://datasets/OWNER/NAME --out ~/shards      # a Hub dataset, its main branch
      peer data prepare --hub OWNER/NAME --hub-revision v1.0 --include 'data/train-*' --out ~/shards
      peer swarm --data ~/shards                                     # then train on it
      peer data prepare --shards /srv/corpus --base-url https://cdn.example.org/corpus
      peer data prepare --hub-repo me/web-shards --hub-revision 0123...   # list a dataset repository
      peer data prepare --run my_run.toml --train-tokenizer 16384   # a BPE for the run, named by hash
    """
    configure_logging(verbose)
    if source or hub:
        if shards_dir is not None or hub_repo or run_file is not None or preset or train_tokenizer is not None:
            raise click.UsageError("SOURCE/--hub cuts new shards: give it without --shards, --hub-repo, --run, "
                                   "--preset or --train-tokenizer")  # fmt: skip
        _prepare_source(source, hub, out_dir, shard_mb, shard_format, text_field, hub_revision, include,
                        validation_shards, base_url, verbose)  # fmt: skip
        return
    from peer.train.data import is_validation, load_corpus

    if shards_dir is not None or hub_repo:
        try:
            lines = prepare_shards(shards_dir, base_url, hub_repo, hub_revision, validation_shards)
        except LocoError as exc:
            exit_with(exc, verbose=verbose)
        click.echo("\n".join(lines))
        return
    try:
        manifest = resolve_run(run_file, preset) or PRESETS["default"]()
        cache_dir = cache_dir or default_cache_dir()
        data, trained = manifest.data, None
        if train_tokenizer is not None:
            held_out = data.validation_fraction
            texts = (
                d.data.decode("utf-8", "replace") for d in iter_documents(data) if not is_validation(d.name, held_out)
            )
            data, trained = train_for_run(data, train_tokenizer, texts, cache_dir=cache_dir)
        corpus = load_corpus(data, cache_dir=cache_dir)
    except LocoError as exc:
        exit_with(exc, verbose=verbose)
    tok = corpus.tokenizer
    click.echo(
        f"# {describe(manifest.data)}: {corpus.train_files:,} training and {corpus.validation_files:,} "
        f"validation documents, {corpus.train.numel():,} + {corpus.validation.numel():,} tokens "
        f"({tok.kind} tokenizer, {tok.vocab_size:,} ids); cache in {cache_dir}"
    )
    click.echo(
        f'[data]\ncorpus_sha256 = "{corpus.corpus_sha256}"\ncorpus_bytes = {corpus.corpus_bytes}\n'
        f'tokenizer_sha256 = "{tok.sha256}"'
    )
    if trained is not None:
        click.echo(
            f'tokenizer = "bpe"\nvocab_size = {tok.vocab_size}\n# the tokenizer.json: {trained}; publish it and add '
            'tokenizer_source = "hf://datasets/OWNER/NAME@COMMIT/tokenizer.json" (or a path peers can read)'
        )


def _prepare_source(
    source,
    hub,
    out_dir,
    shard_mb,
    shard_format,
    text_field,
    hub_revision,
    include,
    validation_shards,
    base_url,
    verbose,
) -> None:
    """``peer data prepare SOURCE --out DIR`` (peer/shards/build.py)."""
    if source and hub:
        raise click.UsageError("give SOURCE or --hub OWNER/NAME, not both")
    if out_dir is None:
        raise click.UsageError("name the output directory: --out DIR")
    try:
        config = PrepareConfig(
            shard_mb=shard_mb,
            format=shard_format,
            text_field=text_field,
            hub_revision=hub_revision,
            include=tuple(include),
            validation_shards=validation_shards,
            base_url=base_url,
        )
        done = prepare_source(source or f"{HUB_PREFIX}{hub}", out_dir, config)
    except LocoError as exc:
        exit_with(exc, verbose=verbose)
    click.echo("\n".join(done.lines))
    click.echo(f"# {done.summary()}")
