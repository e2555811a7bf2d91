"""`peer data prepare SOURCE --out DIR` (issue #68 item 1): a tree of text files, a directory of JSONL
records and a Hugging Face dataset (a real HTTP server on 127.0.0.1 speaking the Hub's API, through
$HF_ENDPOINT; nothing reaches the internet) each become shards with a hashed list a run loads; the
Hub sees the user's token, for the dataset's download and for a peer's shard download alike."""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from peer.cli import main
from peer.shards.build import PREPARED_NAME
from peer.shards.fetch import Fetcher, hub_source
from peer.shards.index import INDEX_NAME, index_directory, parse_index
from peer.shards.text import html_to_text
from peer.train.sources import shard_documents
from tests.shard_fixtures import ShardServer

REV = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_volunteer_token_123"


def prepare(*args: str):
    result = CliRunner().invoke(main, ["data", "prepare", *args])
    return result


def texts_of(out: Path) -> list[str]:
    """Every document of the shards in ``out``, through the reader peers use."""
    docs = []
    for shard in index_directory(out).shards:
        docs += [d.data.decode("utf-8") for d in shard_documents(out / shard.name, shard.name, "text")]
    return docs


def check_list(out: Path, stdout: str) -> dict:
    """The printed [data] section names OUT/shards.json by hash, and that list names each shard's bytes."""
    data = tomllib.loads(stdout)["data"]
    raw = (out / INDEX_NAME).read_bytes()
    assert data["shards_sha256"] == hashlib.sha256(raw).hexdigest()
    index = parse_index(raw, expected_sha256=data["shards_sha256"], where="test")
    assert data["shard_count"] == len(index.shards) >= 2
    for shard in index.shards:
        assert hashlib.sha256((out / shard.name).read_bytes()).hexdigest() == shard.sha256
        assert (out / shard.name).stat().st_size == shard.size
    return data


def test_a_tree_of_text_files_becomes_shards_holding_each_files_text(tmp_path: Path) -> None:
    src = tmp_path / "notes"
    (src / "code").mkdir(parents=True)
    (src / ".git").mkdir()
    prose = [f"note {i}: volunteers pool their machines to train one model, entry {i}.\n" for i in range(12)]
    for i, text in enumerate(prose):
        (src / f"note{i:02d}.txt").write_text(text, encoding="utf-8")
    (src / "guide.md").write_text("# Guide\n\nRun `peer swarm`.\n", encoding="utf-8")
    (src / "page.html").write_text(
        "<html><head><style>p { color: red }</style></head><body><h1>Title here</h1>"
        "<p>Fish &amp; chips</p><script>alert('no')</script></body></html>",
        encoding="utf-8",
    )
    (src / "code" / "mod.py").write_text("def answer():\n    return 42\n", encoding="utf-8")
    (src / "scan.txt").write_bytes(b"%PDF-1.4\0\x01binary")  # skipped and counted
    (src / "photo.png").write_bytes(b"\x89PNG\r\n")  # another kind: left out
    (src / ".git" / "config").write_text("[core]\n")  # hidden: never entered
    out = tmp_path / "shards"

    result = prepare(str(src), "--out", str(out))

    assert result.exit_code == 0, result.output
    check_list(out, result.stdout)
    docs = texts_of(out)
    assert Counter(docs) == Counter(
        [*prose, "# Guide\n\nRun `peer swarm`.\n", "Title here\n\nFish & chips", "def answer():\n    return 42\n"]
    )
    assert not any("<" in d or "alert" in d or "color" in d or "PDF" in d or "core" in d for d in docs)
    last = result.stdout.strip().splitlines()[-1]
    assert "read 16 files, 1 skipped as binary or not UTF-8, 1 of other kinds left out" in last
    assert "15 documents" in last and f"peer swarm --data {out}" in last
    assert json.loads((out / PREPARED_NAME).read_text())["source"] == str(src)
    # the same tree gives the same shards, byte for byte: the list's hash is the corpus's name
    listed = (out / INDEX_NAME).read_bytes()
    again = prepare(str(src), "--out", str(out))
    assert again.exit_code == 0, again.output
    assert (out / INDEX_NAME).read_bytes() == listed


def test_a_jsonl_directory_is_cut_again_into_shards_of_the_size_asked(tmp_path: Path) -> None:
    src = tmp_path / "export"
    src.mkdir()
    records = [f"record {i}: " + "word " * (10 + i % 7) for i in range(300)]
    for k in range(3):
        lines = [json.dumps({"content": r, "id": i}) for i, r in enumerate(records[k * 100 : (k + 1) * 100])]
        (src / f"dump-{k}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "shards"

    result = prepare(str(src), "--out", str(out), "--shard-mb", "0.002", "--format", "jsonl", "--text-field", "content")

    assert result.exit_code == 0, result.output
    check_list(out, result.stdout)
    assert Counter(texts_of(out)) == Counter(records)
    index = index_directory(out)
    assert all(s.name.endswith(".jsonl") for s in index.shards)
    sizes = [sum(len(t.encode()) for t in texts_of_shard(out / s.name)) for s in index.shards]
    longest = max(len(r.encode()) for r in records)
    assert all(2000 <= size < 2000 + longest for size in sizes[:-1]), sizes  # about --shard-mb of text each


def texts_of_shard(path: Path) -> list[str]:
    return [d.data.decode("utf-8") for d in shard_documents(path, path.name, "text")]


def test_bad_sources_and_outputs_are_one_line_exit_78(tmp_path: Path) -> None:
    missing = prepare(str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    assert missing.exit_code == 78 and "nowhere" in missing.output
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"text {i}\n")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.tex").write_text("mine")
    refused = prepare(str(src), "--out", str(busy))
    assert refused.exit_code == 78 and "thesis.tex" in refused.output
    assert (busy / "thesis.tex").read_text() == "mine"
    assert prepare(str(src)).exit_code == 2  # no --out


def test_html_is_stripped_to_its_text() -> None:
    page = "<p>One&nbsp;two</p><div>three<br>four</div><noscript>x</noscript><pre>  a  b </pre>"
    assert html_to_text(page) == "One two\n\nthree\nfour\n\na b"  # blocks apart, a blank line between them


@pytest.fixture
def hub(tmp_path: Path, monkeypatch):
    """A dataset repository served as the Hub would, the client pointed at it with a token set and its
    cache in tmp_path."""
    import huggingface_hub.constants as hf_constants

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    texts = [f"hub document {i}: shards come from a dataset repository" for i in range(60)]
    for k in range(2):
        lines = [json.dumps({"text": t}) for t in texts[k * 30 : (k + 1) * 30]]
        (repo / "data" / f"train-{k}.jsonl").write_text("\n".join(lines) + "\n")
    (repo / "README.md").write_text("---\nlicense: mit\n---\n# the dataset card\n")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))  # read at import
    with ShardServer(repo, revision=REV) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server, texts


def test_a_hub_dataset_is_downloaded_with_the_token_and_its_commit_pinned(hub, tmp_path: Path) -> None:
    server, texts = hub
    out = tmp_path / "shards"

    result = prepare(f"hf://datasets/{server.repo}", "--out", str(out))

    assert result.exit_code == 0, result.output
    check_list(out, result.stdout)
    assert Counter(texts_of(out)) == Counter(texts)  # the records, not the dataset card
    prepared = json.loads((out / PREPARED_NAME).read_text())
    assert prepared["revision"] == REV and prepared["source"] == f"hf://datasets/{server.repo}@{REV}"
    assert server.auth and all(a == f"Bearer {TOKEN}" for a in server.auth)
    assert {name for name, _ in server.requests} == {"data/train-0.jsonl", "data/train-1.jsonl"}
    cached = tmp_path / "hf" / "hub" / "datasets--team--corpus" / "snapshots" / REV / "data"
    assert sorted(p.name for p in cached.iterdir()) == ["train-0.jsonl", "train-1.jsonl"]
    # again, by --hub: the library's cache serves the files, nothing is downloaded twice
    gets, listed = len(server.requests), (out / INDEX_NAME).read_bytes()
    again = prepare("--hub", server.repo, "--hub-revision", REV, "--out", str(out))
    assert again.exit_code == 0, again.output
    assert len(server.requests) == gets
    assert (out / INDEX_NAME).read_bytes() == listed


def test_an_unknown_hub_dataset_is_one_line_exit_78(hub, tmp_path: Path) -> None:
    result = prepare("hf://datasets/team/nothing", "--out", str(tmp_path / "o"))
    assert result.exit_code == 78, result.output
    [line] = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert "team/nothing" in line and "HF_TOKEN" in line


def test_a_peer_downloads_a_shard_from_the_hub_with_the_users_token(hub, tmp_path: Path) -> None:
    server, _ = hub
    index = index_directory(server.root)
    shard = index.shards[0]
    dest = tmp_path / "store" / "s.jsonl"
    dest.parent.mkdir()
    assert Fetcher([hub_source(server.repo, REV)]).fetch(shard, dest).startswith("dataset team/corpus")
    assert dest.read_bytes() == (server.root / shard.name).read_bytes()
    assert server.auth and all(a == f"Bearer {TOKEN}" for a in server.auth)
    assert list(tmp_path.glob("hf/hub/*")) == []  # staged beside the store, not in the library's cache
