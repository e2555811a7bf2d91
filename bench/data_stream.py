"""Benchmark: a sharded corpus streamed over HTTP on loopback, small against large (issue #52 item 5).

    nice .venv/bin/python bench/data_stream.py [--corpora 50e6:5,5e9:500] [--workdir /tmp/data_stream]

For each corpus (total bytes : shards) it generates parquet shards of text (uncompressed, so file
bytes are text bytes), writes their list as ``peer data prepare --shards`` does, serves them from a
real HTTP server on 127.0.0.1 (tests/shard_fixtures.py, the CDN path) and runs, in a fresh process
per corpus, what ``peer join`` does between reading the run and its first inner step:
:func:`peer.shards.corpus.load_sharded` (the list, the validation shard, fetched, hash-checked and
tokenized), the peer's :class:`~peer.shards.stream.ShardSampler` and the default run's model and
inner loop (``RunManifest()``: byte tokenizer, 128-token sequences, 2,048 tokens per step), then:

- ``time_to_first_step_s``: from the start of load_sharded to the end of the first inner step (the
  DHT's start, the same for any corpus, is not counted);
- ``inner_tokens_per_s``: tokens per second of 5 more inner steps (the data already tokenized);
- ``loader_tokens_per_s``: tokens per second of the loader alone: 3 more shards downloaded over
  loopback, hash-checked and tokenized, one after another;
- ``peak_rss_mib``: the process's peak resident memory (``ru_maxrss``);
- ``disk_mib``: the most bytes the shard store held at once (the cap: ``--data-cache-gb``).

Writes bench/results/data_stream.json (``{"corpora": [{"bytes", "shards", "time_to_first_step_s",
"peak_rss_mib", "disk_mib", "loader_tokens_per_s", "inner_tokens_per_s"}]}``) and prints a markdown
table.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "data_stream.json"
CAP_BYTES = 2_000_000_000
"""--data-cache-gb 2: below the 5 GB corpus."""


def generate(root: Path, total: int, shards: int) -> None:
    """``shards`` parquet files of about ``total / shards`` bytes each, every one distinct: a pool
    of documents rotated by a per-shard offset, the first document naming the shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.shard_fixtures import WORDS

    per = total // shards
    rng = random.Random(0)
    pool, size = [], 0
    while size < per:
        doc = " ".join(rng.choices(WORDS, k=rng.randint(100, 600)))
        pool.append(doc)
        size += len(doc)
    root.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        at = (k * 7919) % len(pool)
        docs = [f"shard {k}: {pool[at]}", *pool[at + 1 :], *pool[:at]]
        pq.write_table(pa.table({"text": docs}), root / f"part-{k:05d}.parquet", compression="none")


def measure(corpus: Path, base_url: str, cache: Path) -> dict:
    """In this (fresh) process: the figures of one corpus (see the module docstring)."""
    import torch

    from peer.shards.corpus import ShardedRun, load_sharded
    from peer.shards.index import INDEX_NAME, parse_index
    from peer.shards.stream import tokenize_file
    from peer.train.data import BatchSampler
    from peer.train.inner import InnerLoop
    from peer.train.model import build_model
    from protocol.manifest import DataSpec, RunManifest

    torch.set_num_threads(2)
    index = parse_index((corpus / INDEX_NAME).read_bytes(), expected_sha256=None, where=str(corpus))
    run = RunManifest()
    spec = DataSpec(
        source="shards",
        shards_sha256=index.sha256,
        shard_count=len(index.shards),
        shards_bytes=index.total_bytes,
        base_url=base_url,
        seq_len_tokens=run.data.seq_len_tokens,
    )
    start = time.perf_counter()
    data = load_sharded(spec, cache_dir=cache, cache_bytes=CAP_BYTES)
    run_data = data.make_sampler
    assert isinstance(run_data, ShardedRun)
    sampler = run_data(
        peer_id="bench-peer", run_key="bench", seq_len=spec.seq_len_tokens, batch_sequences=run.batch_sequences
    )
    # the BatchSampler interface, as the round loop uses it (peer/round/engine.py)
    inner = InnerLoop(build_model(run.model, data.tokenizer), run.inner_optimizer, cast(BatchSampler, sampler))
    inner.step(0)
    first_step = time.perf_counter() - start
    t = time.perf_counter()
    tokens = sum(inner.step(i).tokens for i in range(1, 6))
    inner_rate = tokens / (time.perf_counter() - t)
    sampler.close()
    store, fetcher = run_data.store, run_data.fetcher
    ahead = [s for s in run_data.training if s != sampler.current_shard][-3:]
    t, tokens = time.perf_counter(), 0
    for shard in ahead:
        path = store.get(shard, fetcher)
        tokens += tokenize_file(path, shard.name, "text", data.tokenizer)[0].size
    loader_rate = tokens / (time.perf_counter() - t)
    return {
        "bytes": index.total_bytes,
        "shards": len(index.shards),
        "time_to_first_step_s": round(first_step, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "disk_mib": round(store.peak_bytes / 2**20, 1),
        "loader_tokens_per_s": round(loader_rate),
        "inner_tokens_per_s": round(inner_rate),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", default="50e6:5,5e9:500", help="total bytes:shards, comma-separated")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/data_stream"))
    parser.add_argument("--keep", action="store_true", help="keep the generated corpora")
    parser.add_argument("--child", nargs=3, metavar=("CORPUS", "URL", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), args.child[1], Path(args.child[2]))))
        return

    from peer.shards.index import INDEX_NAME, index_directory
    from tests.shard_fixtures import ShardServer

    rows = []
    for item in args.corpora.split(","):
        total, shards = int(float(item.split(":")[0])), int(item.split(":")[1])
        corpus = args.workdir / f"corpus-{total}-{shards}"
        if not (corpus / INDEX_NAME).exists():
            shutil.rmtree(corpus, ignore_errors=True)
            t = time.perf_counter()
            generate(corpus, total, shards)
            (corpus / INDEX_NAME).write_bytes(index_directory(corpus).encode())
            print(f"generated {corpus} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        cache = args.workdir / f"cache-{total}-{shards}"
        shutil.rmtree(cache, ignore_errors=True)
        with ShardServer(corpus) as server:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(corpus), server.cdn, str(cache)],
                check=True,
                capture_output=True,
                text=True,
            )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        shutil.rmtree(cache, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(corpus, ignore_errors=True)
    RESULTS.write_text(json.dumps({"corpora": rows}, indent=1) + "\n")
    print(
        "| corpus | shards | time to first step (s) | peak RSS (MiB) | disk (MiB) | loader tokens/s | inner tokens/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['bytes'] / 1e6:,.0f} MB | {r['shards']} | {r['time_to_first_step_s']:.2f} | {r['peak_rss_mib']:.0f} | "
            f"{r['disk_mib']:.0f} | {r['loader_tokens_per_s']:,} | {r['inner_tokens_per_s']:,} |"
        )


if __name__ == "__main__":
    main()
