"""Real peer and bootstrap processes on 127.0.0.1 for integration tests.

Each process runs in its own process group; ``Procs.cleanup`` kills every group, so a failed
test leaves no DHT, averager or p2pd process behind.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.manifest import RunManifest, dump_toml
from protocol.presets import tiny_run

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def make_manifest(**sections: dict[str, Any]) -> RunManifest:
    return tiny_run().replace(**sections)


def write_manifest(directory: Path, manifest: RunManifest) -> Path:
    path = directory / "run.toml"
    path.write_text(dump_toml(manifest))
    return path


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    queue: "queue.Queue[dict[str, Any] | None]" = field(default_factory=queue.Queue)

    def wait_event(self, predicate, timeout_s: float) -> dict[str, Any]:
        """First event (past or future) satisfying ``predicate``; AssertionError on timeout or exit."""
        seen = 0
        deadline = time.monotonic() + timeout_s
        while True:
            while seen < len(self.events):
                event = self.events[seen]
                seen += 1
                if predicate(event):
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.name}: no matching event in {timeout_s} s; log:\n{self.tail()}")
            try:
                item = self.queue.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if item is None and seen >= len(self.events):
                raise AssertionError(f"{self.name} exited ({self.popen.wait()}) before the event; log:\n{self.tail()}")

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout_s} s; log:\n{self.tail()}") from None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class Procs:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[Proc] = []

    def spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as err:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            popen = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=err,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.workdir, env=env)
        proc = Proc(name=name, popen=popen, log=log)
        self.procs.append(proc)

        def read() -> None:
            for raw in popen.stdout:
                try:
                    event = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                proc.events.append(event)
                proc.queue.put(event)
            proc.queue.put(None)

        threading.Thread(target=read, daemon=True).start()
        return proc

    def bootstrap(self, manifest_path: Path) -> tuple[Proc, str]:
        proc = self.spawn("bootstrap", ["-m", "bootstrap", "run", "--host", "127.0.0.1", "--port", "0",
                                        "--identity", str(self.workdir / "bootstrap.key"), "--run", str(manifest_path),
                                        "--log-format", "json"])
        ready = proc.wait_event(lambda e: e.get("event") == "ready", 60)
        return proc, next(a for a in ready["maddrs"] if "/ip4/127.0.0.1/" in a)

    def peer(self, name: str, *args: str) -> Proc:
        return self.spawn(name, ["-m", "peer", "join", "--data-dir", str(self.workdir / name), "--threads", "1",
                                 "--log-format", "json", *args])

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                try:
                    os.kill(proc.popen.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.popen.wait()
            if proc.popen.stdout is not None:
                proc.popen.stdout.close()


def phi_file(workdir: Path, peer: str, run_id: str, round_: int) -> Path:
    return workdir / peer / "runs" / run_id / f"phi-round-{round_:06d}.safetensors"
