"""Real peer and bootstrap processes on 127.0.0.1 for integration tests.

Each process runs in its own process group (peer/launch.py); ``Procs.cleanup`` kills every group,
so a failed test leaves no DHT, averager or p2pd process behind.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from peer.launch import Child, bootstrap_argv, peer_argv, stop_all
from protocol.manifest import RunManifest, dump_toml
from protocol.presets import tiny_run
from protocol.signing import OwnerKey, save_owner_key

PROJECT_ROOT = Path(__file__).resolve().parents[2]

OWNER = OwnerKey.generate()
"""The owner of the tests' runs: every bootstrap node and peer a :class:`Procs` starts holds its key
(``--owner-key``), so any of them may start a run :func:`make_manifest` made."""


def make_manifest(**sections: dict[str, Any]) -> RunManifest:
    """The tiny preset with ``sections`` overridden, owned by :data:`OWNER` (its run id is final)."""
    return tiny_run().replace(**sections).with_owner(OWNER.public_hex)


def write_manifest(directory: Path, manifest: RunManifest) -> Path:
    path = directory / "run.toml"
    path.write_text(dump_toml(manifest))
    return path


class Procs:
    """The children of one test, started with :class:`peer.launch.Child` in ``workdir``."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[Child] = []
        self.owner_key = save_owner_key(OWNER, workdir / "owner.key").path

    def spawn(self, name: str, argv: list[str]) -> Child:
        """Start ``argv`` with its stderr in ``<workdir>/<name>.log``."""
        child = Child(name, argv, log_path=self.workdir / f"{name}.log", cwd=self.workdir, stack_signal=signal.SIGUSR1)
        self.procs.append(child)
        return child.start()

    def bootstrap(self, manifest_path: Path) -> tuple[Child, str]:
        proc = self.spawn(
            "bootstrap",
            bootstrap_argv(
                identity=self.workdir / "bootstrap.key", run=manifest_path, extra=["--owner-key", str(self.owner_key)]
            ),
        )
        ready = proc.wait_event(lambda e: e.kind == "ready", 60)
        return proc, ready.addresses_on("127.0.0.1")[0]

    def peer(self, name: str, *args: str) -> Child:
        return self.spawn(
            name,
            peer_argv(
                data_dir=self.workdir / name, extra=["--threads", "1", "--owner-key", str(self.owner_key), *args]
            ),
        )

    def cleanup(self) -> None:
        """SIGINT every child, give them 20 s to exit, then kill every process group."""
        for proc in self.procs:
            proc.send(signal.SIGINT)
        stop_all(self.procs, 20.0)
        self.procs.clear()


def phi_file(workdir: Path, peer: str, run_id: str, round_: int) -> Path:
    return workdir / peer / "runs" / run_id / f"phi-round-{round_:06d}.safetensors"


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (its helpers: DHT, p2pd, averager), while they run."""
    from peer.net.lifetime import children

    found = [pid]
    for child in children(pid):
        found += process_tree(child)
    return found


def shared_memory_files(pids: list[int]) -> list[str]:
    """Files in /dev/shm that torch's shared memory made for tensors of any of ``pids``
    (``torch_<pid>_...``: its file_system strategy's names); none where there is no /dev/shm."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    return sorted(f.name for f in shm.iterdir() if f.name.startswith(prefixes))
