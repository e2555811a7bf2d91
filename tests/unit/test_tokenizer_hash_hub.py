"""A tokenizer fetched by hash from a Hugging Face repository at a pinned commit, with huggingface_hub
against a real HTTP server on 127.0.0.1 that answers as the Hub does (tests/unit/tokenizer_hub.py)."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from peer.train import bpe
from protocol.errors import ConfigError
from protocol.manifest import DataSpec
from tests.unit.tokenizer_hub import serve_hub

TEXTS = [f"for peer in group_{i}:\n    peer.send(delta[{i}])  # ünï\n" for i in range(200)]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def trained(texts: list[str] = TEXTS) -> bytes:
    return bpe.train_bpe(iter(texts), 512).to_str().encode("utf-8")


def spec(sha256: str, source: str) -> DataSpec:
    return DataSpec(tokenizer="bpe", vocab_size=512, tokenizer_sha256=sha256, tokenizer_source=source)


@pytest.mark.parametrize("repo_type", ["dataset", "model"])
def test_a_peer_fetches_the_tokenizer_at_the_pinned_commit_once(tmp_path, monkeypatch, repo_type):
    data = trained()
    want = hashlib.sha256(data).hexdigest()
    with serve_hub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        source = hub.put("volunteers/web-run", COMMIT, "tok/tokenizer.json", data, repo_type=repo_type)
        hub.put("volunteers/web-run", "f" * 40, "tok/tokenizer.json", trained(TEXTS[:50]), repo_type=repo_type)
        tok = bpe.load_tokenizer(spec(want, source), cache_dir=tmp_path / "cache")
        assert tok.sha256 == want and tok.kind == "bpe"
        prefix = "/datasets" if repo_type == "dataset" else ""
        assert ("GET", f"{prefix}/volunteers/web-run/resolve/{COMMIT}/tok/tokenizer.json") in hub.requests
        assert bpe.store_path(tmp_path / "cache", want).read_bytes() == data
    # the Hub gone: a second start reads the store and asks nobody
    assert bpe.load_tokenizer(spec(want, source), cache_dir=tmp_path / "cache").sha256 == want


def test_a_hub_file_whose_bytes_differ_is_refused_naming_both_hashes(tmp_path, monkeypatch):
    want, served = hashlib.sha256(trained()).hexdigest(), trained(TEXTS[:80])
    with serve_hub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        source = hub.put("volunteers/web-run", COMMIT, "tokenizer.json", served)
        with pytest.raises(ConfigError) as info:
            bpe.load_tokenizer(spec(want, source), cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert info.value.exit_code == 78 and "\n" not in message
    assert want in message and hashlib.sha256(served).hexdigest() in message and source in message
    assert not bpe.store_path(tmp_path / "cache", want).exists()


@pytest.mark.parametrize(
    "repo, commit, path, named",
    [
        ("volunteers/other", COMMIT, "tokenizer.json", "RepositoryNotFoundError"),
        ("volunteers/web-run", "e" * 40, "tokenizer.json", "RevisionNotFoundError"),
        ("volunteers/web-run", COMMIT, "tokenizers/missing.json", "EntryNotFoundError"),
    ],
)
def test_a_repository_commit_or_file_the_hub_lacks_is_a_config_error(tmp_path, monkeypatch, repo, commit, path, named):
    with serve_hub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.put("volunteers/web-run", COMMIT, "tokenizer.json", trained())
        source = f"hf://datasets/{repo}@{commit}/{path}"
        with pytest.raises(ConfigError) as info:
            bpe.load_tokenizer(spec("a" * 64, source), cache_dir=tmp_path / "cache")
    assert info.value.exit_code == 78 and source in str(info.value) and named in str(info.value)


def test_a_server_that_is_not_a_hub_is_unavailable_exit_69(tmp_path, monkeypatch):
    class NotAHub(BaseHTTPRequestHandler):  # answers every request, but without the Hub's headers
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotAHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        with pytest.raises(bpe.TokenizerUnavailable) as info:
            bpe.load_tokenizer(spec("a" * 64, f"hf://datasets/me/tok@{COMMIT}/tokenizer.json"), cache_dir=tmp_path)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert info.value.exit_code == 69 and f"cannot reach {endpoint}" in str(info.value)
