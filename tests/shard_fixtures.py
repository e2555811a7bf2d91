"""Real parquet shards and a real HTTP server on 127.0.0.1 serving them as a CDN and as a Hugging
Face hub would (tests of peer/shards/ and bench/data_stream.py). Nothing reaches the internet.

The server answers ``GET /cdn/<name>`` (a plain base URL), ``GET /api/datasets/<repo>/tree/<rev>``
(the hub's listing, as ``huggingface_hub.HfApi.list_repo_tree`` reads it), ``GET
/api/datasets/<repo>/revision/<rev>`` (``HfApi.dataset_info``, also without ``/revision/<rev>``: the commit a branch points at and the
files) and ``HEAD``/``GET /datasets/<repo>/resolve/<rev>/<name>`` with the headers
``hf_hub_download`` reads (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``), each with HTTP Range
support; ``<rev>`` is the commit or ``main``. ``auth`` records the Authorization header of every request. Faults on demand: ``cut``
(names whose next download stops half-way), ``missing`` (answered 404) and ``corrupt`` (names the CDN path serves with one byte
flipped; the hub path serves them intact).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not have which but "
    "data peer shard model train token stream round sync average gradient loss step corpus hash list"
).split()


def write_shards(root: Path, count: int, docs_per_shard: int, *, words_per_doc: int = 60, seed: int = 0) -> list[Path]:
    """``count`` parquet files ``part-00000.parquet``... of random-word documents under ``root``."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(count):
        texts = [f"doc {k}.{d}: " + " ".join(rng.choices(WORDS, k=words_per_doc)) for d in range(docs_per_shard)]
        path = root / f"part-{k:05d}.parquet"
        pq.write_table(pa.table({"text": texts}), path, compression="zstd")
        paths.append(path)
    return paths


class ShardServer:
    """A ThreadingHTTPServer on 127.0.0.1 serving the files under ``root``; a context manager."""

    def __init__(self, root: Path, *, repo: str = "team/corpus", revision: str = "a" * 40):
        self.root, self.repo, self.revision = Path(root), repo, revision
        self.cut: set[str] = set()
        self.corrupt: set[str] = set()
        self.missing: set[str] = set()
        """Names answered 404, as a CDN that lacks them."""
        self.requests: list[tuple[str, str | None]] = []
        """(file name, Range header) of every file GET."""
        self.auth: list[str | None] = []
        """The Authorization header of every request, in order."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self)

            def do_HEAD(self) -> None:
                server._handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def cdn(self) -> str:
        return self.url + "/cdn"

    def __enter__(self) -> ShardServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        self.auth.append(h.headers.get("Authorization"))
        path = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path)
        if path == f"/api/datasets/{self.repo}":  # dataset_info without a revision: the main branch
            return self._info(h)
        for rev in (self.revision, "main"):
            if path == f"/api/datasets/{self.repo}/tree/{rev}":
                return self._listing(h)
            if path == f"/api/datasets/{self.repo}/revision/{rev}":
                return self._info(h)
            resolve = f"/datasets/{self.repo}/resolve/{rev}/"
            if path.startswith(resolve):
                return self._file(h, path[len(resolve) :], cdn=False)
        if path.startswith("/cdn/"):
            return self._file(h, path[len("/cdn/") :], cdn=True)
        if path.startswith("/api/"):  # what huggingface_hub reads as an unknown repository
            h.send_response(404)
            h.send_header("X-Error-Code", "RepoNotFound")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_error(404)

    def _files(self) -> list[Path]:
        return [p for p in sorted(self.root.rglob("*")) if p.is_file()]

    def _info(self, h: BaseHTTPRequestHandler) -> None:
        siblings = [{"rfilename": p.relative_to(self.root).as_posix()} for p in self._files()]
        body = json.dumps({"id": self.repo, "sha": self.revision, "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _listing(self, h: BaseHTTPRequestHandler) -> None:
        entries = []
        for p in self._files():
            data = p.read_bytes()
            name = p.relative_to(self.root).as_posix()
            entry = {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            if p.suffix in (".parquet", ".jsonl"):
                entry["lfs"] = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 130}
            entries.append(entry)
        body = json.dumps(entries).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _file(self, h: BaseHTTPRequestHandler, name: str, *, cdn: bool) -> None:
        file = self.root / name
        if ".." in name.split("/") or not file.is_file() or name in self.missing:
            h.send_error(404)
            return
        rng = h.headers.get("Range")
        data = file.read_bytes()
        if cdn and name in self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
        body = data[start:]
        h.send_response(206 if rng else 200)
        h.send_header("Content-Length", str(len(body)))
        if not cdn:
            h.send_header("X-Repo-Commit", self.revision)
            h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            if file.suffix in (".parquet", ".jsonl"):
                h.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
                h.send_header("X-Linked-Size", str(len(data)))
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if h.command == "HEAD":
            return
        self.requests.append((name, rng))
        if name in self.cut:
            self.cut.discard(name)
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(body)
