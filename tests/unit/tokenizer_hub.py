"""A Hugging Face Hub as huggingface_hub's ``hf_hub_download`` sees it, on 127.0.0.1: the standard
library's HTTP server answering ``HEAD``/``GET /[datasets/]OWNER/NAME/resolve/COMMIT/FILE`` with the
headers the Hub sends (``X-Repo-Commit``, ``ETag``, ``Content-Length``) and its ``X-Error-Code`` 404s.
Tests point the client at it with ``HF_ENDPOINT``; nothing reaches the internet."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RESOLVE = re.compile(r"/(?:(datasets)/)?([\w.-]+/[\w.-]+)/resolve/([^/]+)/(.+)")


class Hub:
    """Files by (repo type, repo id, commit, path); ``requests`` records each (method, path)."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, str, str, str], bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.url = ""

    def put(self, repo_id: str, commit: str, path: str, data: bytes, *, repo_type: str = "dataset") -> str:
        """Serve ``data`` as ``path`` of ``repo_id`` at ``commit``; returns its hf:// name."""
        self.files[(repo_type, repo_id, commit, path)] = data
        prefix = "datasets/" if repo_type == "dataset" else ""
        return f"hf://{prefix}{repo_id}@{commit}/{path}"


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def _answer(self, body: bool) -> None:
            hub.requests.append((self.command, self.path))
            match = _RESOLVE.fullmatch(self.path)
            if match is None:
                return self._error(404, "RepoNotFound")
            datasets, repo_id, commit, path = match.groups()
            repo_type = "dataset" if datasets else "model"
            held = [k for k in hub.files if k[:2] == (repo_type, repo_id)]
            if not held:
                return self._error(404, "RepoNotFound")
            if not any(k[2] == commit for k in held):
                return self._error(404, "RevisionNotFound")
            data = hub.files.get((repo_type, repo_id, commit, path))
            if data is None:
                return self._error(404, "EntryNotFound", commit)
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, commit: str | None = None) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

    return Handler


@contextmanager
def serve_hub() -> Iterator[Hub]:
    """A :class:`Hub` listening on 127.0.0.1 (any free port; ``hub.url`` is its endpoint) until the block ends."""
    hub = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
