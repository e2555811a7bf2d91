"""Benchmark: a real corpus cut by ``peer data prepare``, streamed over HTTP on loopback, small against
large (issue #52 item 5, issue #68 item 2).

    nice .venv/bin/python bench/data_stream.py [--workdir /tmp/data_stream] [--shard-mb 16]

The text is the Linux kernel's source tree as Debian ships it, the package ``linux-source-6.1``
(``--package-version``, default 6.1.192-3): fetched with ``apt-get download`` (a Debian registry is all
it needs), unpacked with ``dpkg-deb -x`` and ``tar``, and cut by the project's own converter,
``peer data prepare SRC --out DIR --shard-mb N`` (peer/shards/build.py: C sources, headers, docs,
scripts, each file one document, parquet zstd shards of about N MB of text). The large corpus is the
whole tree (1,224.7 MB of text, 71 shards at 16 MB), the small one its ``kernel/`` subtree (11.7 MB,
105× less, which the converter cuts into 8 shards as it does any corpus under 8 shards' worth). The
converter's default, 64 MB, gives the large corpus 19 shards; 16 MB gives it over 50. Everything is
cached under ``--workdir`` (outside the repository): the .deb (139 MB), the unpacked tree (1.3 GB)
and the shards (243 MB).

Each corpus is served from a real HTTP server on 127.0.0.1 (tests/shard_fixtures.py, the CDN path)
and measured in a fresh process doing what ``peer join`` does between reading the run and its first
inner step: :func:`peer.shards.corpus.load_sharded` (the list, the validation shard fetched,
hash-checked and tokenized), the peer's :class:`~peer.shards.stream.ShardSampler`, and the default
run's model and inner loop (``RunManifest()``: 128-token sequences, 16 per step) with the pinned BPE
the llama-* presets use (peer/assets/tokenizers/stdlib-bpe-16384.json, by its SHA-256). Then one
peer's full pass: a new sampler of the same peer draws every batch of every training shard once, in
its ring order, through its loader thread (download, hash check, BPE). Per corpus:

- ``time_to_first_step_s``: from the start of load_sharded to the end of the first inner step (the
  DHT's start, the same for any corpus, is not counted);
- ``inner_tokens_per_s``: tokens per second of 5 more inner steps;
- ``shards_read``, ``pass_tokens``, ``pass_s``: the full pass's training shards, tokens and seconds;
  ``loader_tokens_per_s`` is ``pass_tokens / pass_s`` (the loader bounds the pass: drawing a batch
  is a copy);
- ``peak_rss_mib``: the process's peak resident memory (``ru_maxrss``); ``rss_*``: VmRSS sampled
  every 0.5 s by a thread (``rss_samples`` samples): the highest, and the median and highest during
  the pass, and its growth over the pass (last sample less first);
- ``disk_mib``: the most bytes the shard store held at once (the cap: ``--cache-mb``, below the
  large corpus's bytes on disk, so eviction runs).

Writes bench/results/data_stream.json (``text``, ``tokenizer``, ``shard_mb``, ``cache_cap_mib``,
``corpora`` (one row per corpus with the keys above and ``name``, ``text``, ``bytes`` (shard files),
``text_bytes``, ``shards``), ``ratios`` (large over small), ``commit``, ``device``, ``command``,
``load_average_start``, ``load_average_end``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.provenance import git_commit  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "data_stream.json"
PACKAGE = "linux-source-6.1"
SMALL_SUBTREE = "kernel"
TOKENIZER = "stdlib-bpe-16384"
RSS_EVERY_S = 0.5


# -- the corpus ---------------------------------------------------------------------------------


def fetch_source(workdir: Path, version: str) -> tuple[Path, str]:
    """The unpacked kernel tree under ``workdir`` (downloaded and unpacked once) and the package's
    ``name version``.

    Raises:
        SystemExit: apt-get, dpkg-deb or tar failed (their own message is on stderr).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    pattern = f"{PACKAGE}_{version or '*'}_all.deb"
    deb = next(iter(sorted(workdir.glob(pattern))), None)
    if deb is None:
        wanted = f"{PACKAGE}={version}" if version else PACKAGE
        _run(["apt-get", "download", wanted], cwd=workdir)
        deb = next(iter(sorted(workdir.glob(pattern))))
    got = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True)
    label = f"{PACKAGE} {got.stdout.strip()}"
    tree = workdir / "src" / PACKAGE
    if not (tree / "Makefile").is_file():
        unpacked = workdir / "deb"
        shutil.rmtree(unpacked, ignore_errors=True)
        shutil.rmtree(workdir / "src", ignore_errors=True)
        _run(["dpkg-deb", "-x", str(deb), str(unpacked)])
        tarball = next(unpacked.glob(f"usr/src/{PACKAGE}.tar.xz"))
        (workdir / "src").mkdir()
        _run(["tar", "-C", str(workdir / "src"), "-xJf", str(tarball)])
        shutil.rmtree(unpacked)
    return tree, label


def cut(source: Path, out: Path, shard_mb: float) -> None:
    """``peer data prepare SOURCE --out OUT --shard-mb N``, unless ``out`` already holds its output
    at that size (its ``prepared.json``, written last)."""
    record = out / "prepared.json"
    if record.is_file() and json.loads(record.read_text()).get("shard_mb") == shard_mb:
        return
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "peer", "data", "prepare", str(source), "--out", str(out)]
    _run([*command, "--shard-mb", f"{shard_mb:g}"], cwd=ROOT)


def _run(command: list[str], cwd: Path | None = None) -> None:
    if subprocess.run(command, cwd=cwd).returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` failed (its message is above): fix that and run again")


# -- one corpus, in a fresh process ---------------------------------------------------------------


class RssSampler:
    """VmRSS of this process every :data:`RSS_EVERY_S` seconds, on a daemon thread, in MiB."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")
        self._thread.start()

    @staticmethod
    def now_mib() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def _loop(self) -> None:
        while True:
            self.samples.append((time.perf_counter(), self.now_mib()))
            if self._stop.wait(RSS_EVERY_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[float]:
        return [mib for t, mib in self.samples if start <= t <= end]


def full_pass(sampler, shards: int) -> None:
    """Draw batches until every one of the ``shards`` training shards was read once (the last batch
    that would run into the next epoch is not drawn)."""
    while not (
        sampler.consumed == shards - 1
        and sampler.current is not None
        and sampler.offset + sampler.batch_sequences > len(sampler.order)
    ):
        sampler.next_batch()


def measure(corpus: Path, base_url: str, cache: Path, cap_bytes: int) -> dict:
    """In this (fresh) process: the figures of one corpus (see the module docstring)."""
    rss = RssSampler()
    import torch

    from peer.shards.corpus import ShardedRun, load_sharded
    from peer.shards.index import INDEX_NAME, parse_index
    from peer.train.data import BatchSampler
    from peer.train.inner import InnerLoop
    from peer.train.model import build_model
    from protocol.manifest import RunManifest
    from protocol.presets import STDLIB_BPE_16384_SHA256

    torch.set_num_threads(2)
    index = parse_index((corpus / INDEX_NAME).read_bytes(), expected_sha256=None, where=str(corpus))
    run = RunManifest().replace(
        data={
            "source": "shards",
            "shards_sha256": index.sha256,
            "shard_count": len(index.shards),
            "shards_bytes": index.total_bytes,
            "base_url": base_url,
            "tokenizer": "bpe",
            "vocab_size": 16384,
            "tokenizer_sha256": STDLIB_BPE_16384_SHA256,
        }
    )
    start = time.perf_counter()
    data = load_sharded(run.data, cache_dir=cache, cache_bytes=cap_bytes)
    run_data = data.make_sampler
    assert isinstance(run_data, ShardedRun)

    def sampler_of():
        return run_data(
            peer_id="bench-peer", run_key="bench", seq_len=run.data.seq_len_tokens, batch_sequences=run.batch_sequences
        )

    sampler = sampler_of()
    # the BatchSampler interface, as the round loop uses it (peer/round/engine.py)
    inner = InnerLoop(build_model(run.model, data.tokenizer), run.inner_optimizer, cast(BatchSampler, sampler))
    inner.step(0)
    first_step = time.perf_counter() - start
    t = time.perf_counter()
    tokens = sum(inner.step(i).tokens for i in range(1, 6))
    inner_rate = tokens / (time.perf_counter() - t)
    sampler.close()

    shards = len(run_data.training)
    pass_start = time.perf_counter()
    walker = sampler_of()
    full_pass(walker, shards)
    pass_end = time.perf_counter()
    walker.close()
    rss.stop()
    during = rss.between(pass_start, pass_end) or [rss.now_mib()]
    prepared = json.loads((corpus / "prepared.json").read_text())
    return {
        "bytes": index.total_bytes,
        "shards": len(index.shards),
        "shard_mb": prepared["shard_mb"],
        "time_to_first_step_s": round(first_step, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_sampled_peak_mib": round(max(mib for _, mib in rss.samples), 1),
        "rss_pass_p50_mib": round(statistics.median(during), 1),
        "rss_pass_peak_mib": round(max(during), 1),
        "rss_pass_growth_mib": round(during[-1] - during[0], 1),
        "rss_samples": len(rss.samples),
        "disk_mib": round(run_data.store.peak_bytes / 2**20, 1),
        "shards_read": walker.consumed + 1,
        "pass_tokens": walker.tokens_loaded,
        "pass_s": round(pass_end - pass_start, 1),
        "loader_tokens_per_s": round(walker.tokens_loaded / (pass_end - pass_start)),
        "inner_tokens_per_s": round(inner_rate),
        "tokenizer_sha256": data.tokenizer.sha256,
    }


# -- the whole benchmark --------------------------------------------------------------------------


def text_bytes_of(corpus: Path) -> int:
    """UTF-8 bytes of text in the shards (their ``text`` column)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    return sum(
        pc.sum(pc.binary_length(pq.read_table(p, columns=["text"]).column("text"))).as_py()
        for p in sorted(corpus.glob("part-*.parquet"))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/data_stream"), help="download and shard cache")
    parser.add_argument("--package-version", default="6.1.192-3", help=f"{PACKAGE}'s version ('' : apt's candidate)")
    parser.add_argument("--shard-mb", type=float, default=16.0, help="peer data prepare --shard-mb")
    parser.add_argument("--cache-mb", type=float, default=100.0, help="the peer's shard store cap, MB (10^6 bytes)")
    parser.add_argument("--child", nargs=4, metavar=("CORPUS", "URL", "CACHE", "CAP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        corpus, url, cache, cap = args.child
        print(json.dumps(measure(Path(corpus), url, Path(cache), int(cap))))
        return

    from tests.shard_fixtures import ShardServer

    load_start = os.getloadavg()[0]
    tree, label = fetch_source(args.workdir, args.package_version)
    corpora = [
        ("large", tree, f"{label}: the whole source tree"),
        ("small", tree / SMALL_SUBTREE, f"{label}: its {SMALL_SUBTREE}/ subtree"),
    ]
    cap = int(args.cache_mb * 1e6)
    rows = []
    for name, source, text in reversed(corpora):  # the small one first: its figures come in a minute
        shards = args.workdir / "shards" / name
        cut(source, shards, args.shard_mb)
        cache = args.workdir / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        print(f"measuring the {name} corpus ({shards}) ...", file=sys.stderr)
        with ShardServer(shards) as server:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(shards), server.cdn, str(cache), str(cap)],
                check=True,
                capture_output=True,
                text=True,
            )
        shutil.rmtree(cache, ignore_errors=True)
        row = {
            "name": name,
            "text": text,
            "text_bytes": text_bytes_of(shards),
            **json.loads(out.stdout.splitlines()[-1]),
        }
        rows.append(row)
    rows.reverse()
    large, small = rows
    tokenizer = f"{TOKENIZER} (peer/assets/tokenizers/{TOKENIZER}.json, sha256 {large.pop('tokenizer_sha256')})"
    small.pop("tokenizer_sha256")
    ratios = {
        k: round(large[k] / small[k], 2)
        for k in ("text_bytes", "shards_read", "time_to_first_step_s", "peak_rss_mib", "rss_pass_peak_mib", "disk_mib")
    }
    result = {
        "text": f"{label} (Debian, `apt-get download {PACKAGE}`): the Linux kernel's source tree, cut by "
        f"`peer data prepare --shard-mb {args.shard_mb:g}`",
        "tokenizer": tokenizer,
        "shard_mb": args.shard_mb,
        "cache_cap_mib": round(cap / 2**20, 1),
        "corpora": rows,
        "ratios": ratios,
        "commit": git_commit(ROOT),
        "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores), no GPU",
        "command": "python bench/data_stream.py" + "".join(f" {a}" for a in sys.argv[1:]),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg()[0],
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"text: {result['text']}; tokenizer: {tokenizer}")
    print(
        "| corpus | text | shards | shards read | to first step (s) | peak RSS (MiB) | RSS in pass p50 / max (MiB) "
        "| disk (MiB) | loader tokens/s | inner tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['text_bytes'] / 1e6:,.1f} MB | {r['shards']} | {r['shards_read']} | "
            f"{r['time_to_first_step_s']:.1f} | {r['peak_rss_mib']:.0f} | {r['rss_pass_p50_mib']:.0f} / "
            f"{r['rss_pass_peak_mib']:.0f} | {r['disk_mib']:.0f} | {r['loader_tokens_per_s']:,} | "
            f"{r['inner_tokens_per_s']:,} |"
        )
    print("large / small: " + ", ".join(f"{k} {v:g}×" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
