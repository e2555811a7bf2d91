"""Data that travels (issue 16, item 5), with real processes on loopback: a bootstrap node
announces a run that names its corpus by content only (``data.path = ""``, ``corpus_sha256``
set); a volunteer whose copy lies elsewhere joins with ``--data PATH`` (an extra binary file in
it is skipped and counted), and one whose copy differs is refused with one line and exit 78."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest

from peer.launch import Child, peer_argv, stop_all
from peer.train.data import load_corpus
from protocol.manifest import DataSpec, dump_toml
from protocol.presets import tiny_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WORDS = "volunteers train one model together over a distributed hash table with low communication".split()


def write_corpus(folder: Path, n: int = 40) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40 + i % 9)) + f" (document {i})\n"
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return folder


def test_a_volunteer_trains_on_their_own_copy_and_a_different_copy_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCOSWARM_CACHE_DIR", str(tmp_path / "cache"))
    original = write_corpus(tmp_path / "owner" / "corpus")
    files = DataSpec(source="files", path=str(original), seq_len_tokens=32, validation_sequences=4)
    pinned = load_corpus(files, cache_dir=tmp_path / "cache").corpus_sha256
    run = tiny_run().replace(
        data={
            "source": "files",
            "path": "",
            "corpus_sha256": pinned,
            "validation_sequences": 4,
            "validation_fraction": 0.2,
        }
    )
    (tmp_path / "run.toml").write_text(dump_toml(run))

    mine = tmp_path / "volunteer" / "elsewhere" / "corpus"
    shutil.copytree(original, mine)
    (mine / "scan.txt").write_bytes(b"%PDF-1.4\0\x01 not text")  # skipped: the hash is still the run's
    other = tmp_path / "other" / "corpus"
    shutil.copytree(original, other)
    (other / "doc000.txt").write_text("an edited document\n", encoding="utf-8")

    children: list[Child] = []

    def spawn(name: str, argv: list[str]) -> Child:
        child = Child(name, argv, log_path=tmp_path / f"{name}.log", cwd=tmp_path)
        children.append(child)
        return child.start()

    try:
        boot = spawn(
            "boot",
            [
                sys.executable,
                "-m",
                "bootstrap",
                "run",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--identity",
                str(tmp_path / "boot.key"),
                "--run",
                str(tmp_path / "run.toml"),
                "--log-format",
                "json",
            ],
        )
        ready = boot.wait_event(lambda e: e.kind == "ready", 120)
        [addr] = ready.addresses_on("127.0.0.1")
        good = spawn(
            "good",
            peer_argv(
                data_dir=tmp_path / "good",
                initial_peers=[addr],
                extra=["--threads", "1", "--host", "127.0.0.1", "--data", str(mine)],
            ),
        )
        started = good.wait_event(lambda e: e.kind == "started", 300)
        assert started["run_id"] == ready["run_id"]
        good.send(signal.SIGINT)
        good.wait(60)
        assert "skipped 1 binary or non-UTF-8 file(s)" in good.tail(200) and "scan.txt" in good.tail(200)

        bad = spawn(
            "bad",
            peer_argv(
                data_dir=tmp_path / "bad",
                initial_peers=[addr],
                extra=["--threads", "1", "--host", "127.0.0.1", "--data", str(other)],
            ),
        )
        assert bad.wait(300) == 78
        [line] = [ln for ln in bad.tail(50).splitlines() if ln.startswith("error:")]
        assert pinned in line and str(other) in line and "--data" in line
        assert not bad.of("started")
    finally:
        for child in children:
            child.send(signal.SIGINT)
        stop_all(children, 20.0)
