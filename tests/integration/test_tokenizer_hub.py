"""A tokenizer shipped by hash (issue #52 items 3 and 4), with real processes: the operator trains a
BPE once, a real HTTP server on 127.0.0.1 serves it as the Hugging Face Hub would, and `peer join`
(huggingface_hub against that server, through $HF_ENDPOINT) fetches it and starts training without
training one; a run whose source holds other bytes is refused with both hashes (exit 78), and one
whose source cannot be reached ends in one line (exit 69)."""

from __future__ import annotations

import hashlib
import signal
import socket
from pathlib import Path

import pytest

from peer.launch import Child, peer_argv, stop_all
from peer.train import bpe
from protocol.manifest import dump_toml
from protocol.presets import tiny_run
from tests.unit.tokenizer_hub import serve_hub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

COMMIT = "5e1f0c1e2d3c4b5a69788796a5b4c3d2e1f00112"
WORDS = "each volunteer streams its own shards and averages pseudo gradients with a small group".split()


def write_corpus(folder: Path, n: int = 40) -> list[str]:
    folder.mkdir(parents=True)
    texts = []
    for i in range(n):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(60 + i % 7)) + f" (document {i})\n"
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    return texts


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_fetches_its_tokenizer_by_hash_and_other_bytes_or_no_source_stop_it(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    texts = write_corpus(corpus)
    data = tiny_run().data.__class__(
        source="files", path=str(corpus), seq_len_tokens=32, validation_sequences=4, validation_fraction=0.2
    )
    pinned, file = bpe.train_for_run(data, 512, iter(texts), cache_dir=tmp_path / "operator")
    other = bpe.train_bpe(iter(texts[:10]), 512).to_str().encode("utf-8")
    children: list[Child] = []

    def join(name: str, source: str) -> Child:
        run = tiny_run().replace(data={**pinned.__dict__, "tokenizer_source": source})
        (tmp_path / f"{name}.toml").write_text(dump_toml(run))
        argv = peer_argv(data_dir=tmp_path / name, extra=["--run", str(tmp_path / f"{name}.toml"), "--threads", "1"])
        child = Child(name, [*argv, "--host", "127.0.0.1"], log_path=tmp_path / f"{name}.log", cwd=tmp_path)
        children.append(child)
        return child.start()

    def error_line(child: Child) -> str:
        """The one line the child's stderr ends with; before it, only the peer's own heartbeat while it
        waits (no retry lines of the Hub client)."""
        *before, line = [line for line in child.tail(80).splitlines() if line.strip()]
        assert line.startswith("error: ") and all(b.startswith("still reading the run's data") for b in before)
        return line

    try:
        with serve_hub() as hub:
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "volunteer-cache"))  # holds no tokenizer
            source = hub.put("volunteers/web-run", COMMIT, "tokenizer.json", file.read_bytes())
            wrong = hub.put("volunteers/web-run", COMMIT, "other/tokenizer.json", other)

            good = join("good", source)
            good.wait_event(lambda e: e.kind == "started", 300)
            good.send(signal.SIGINT)
            good.wait(60)
            assert ("GET", f"/datasets/volunteers/web-run/resolve/{COMMIT}/tokenizer.json") in hub.requests
            assert "training a" not in good.tail(400)  # no BPE was trained at join
            stored = bpe.store_path(tmp_path / "volunteer-cache", pinned.tokenizer_sha256)
            assert stored.read_bytes() == file.read_bytes()

            # another machine, whose store does not hold the run's tokenizer (this one's does, by hash)
            monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "bad-cache"))
            bad = join("bad", wrong)
            assert bad.wait(300) == 78
            line = error_line(bad)
            assert pinned.tokenizer_sha256 in line and hashlib.sha256(other).hexdigest() in line and wrong in line
            assert not bad.of("started")

        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
        monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "fresh-cache"))
        gone = join("gone", source)
        assert gone.wait(300) == 69
        line = error_line(gone)
        assert "cannot reach http://127.0.0.1:" in line and source in line
        assert not gone.of("started")
    finally:
        for child in children:
            child.send(signal.SIGINT)
        stop_all(children, 20.0)
