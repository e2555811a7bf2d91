"""CI check of the docker compose swarm: build the images, run a bootstrap node and 3 peers with
docker/docker-compose.yml, wait until every peer completed at least 2 rounds in a group of 3 (as
the monitor's JSON reports them), check that the validation loss fell, tear everything down.

Run as root (CI: ``.ci/run`` calls it); it installs Debian's docker.io, docker-compose and
debootstrap when they are missing, starts its own dockerd and stops it at the end:

    python tests/docker/compose_swarm.py            # exit 0: passed (or skipped, with the reason)

The daemon it starts is private to this check (own socket, data root, exec root) and is started
with ``--iptables=false --ip-forward=false --bridge=none``: it adds no iptables rule, does not
turn on IP forwarding or bridge netfilter, and leaves no docker0 bridge, so it cannot break the
network-namespace tests that run on the same machine. Containers talk over the compose network's
bridge; the host reaches the monitor through docker-proxy; image builds use the host network.

What remains afterwards: the packages it installed, and the images in the data root
(``$LOCOSWARM_DOCKER_ROOT``, default /var/lib/locoswarm-ci/docker) as a build cache for the next
run; ``--clean`` (the default when CI=true) removes that folder too.

Environment: LOCOSWARM_ARTIFACTS (where logs and the final monitor JSON go; default
tests/artifacts), LOCOSWARM_COMPOSE_PRESET (run preset, default 'default'),
LOCOSWARM_COMPOSE_TIMEOUT_S (wait for the rounds, default 600), LOCOSWARM_COMPOSE (the compose
command: default ``docker-compose``, Debian's 1.29; e.g. ``docker compose`` for v2).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = 3
ROUNDS_IN_FULL_GROUP = 2
RUN_DIR = Path("/run/locoswarm-ci")
SOCKET = RUN_DIR / "docker.sock"
BASE_IMAGE = "locoswarm-base:bookworm"
IMAGE = "locoswarm:ci"
PROJECT = "locoswarm-ci"
UPLINK_RATE = "200mbit"
DEBIAN_PACKAGES = ("docker.io", "docker-compose", "debootstrap", "iptables")


class Skip(Exception):
    """A Docker engine cannot run here; the message says why."""


def log(msg: str) -> None:
    print(f"[compose-swarm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(argv: list[str], *, env: dict | None = None, check: bool = True, capture: bool = False,
        timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, env=env, text=True, timeout=timeout,
                         stdout=subprocess.PIPE if capture else None,
                         stderr=subprocess.STDOUT if capture else None, **kw)
    if check and out.returncode != 0:
        tail = (out.stdout or "")[-3000:] if capture else ""
        raise RuntimeError(f"{' '.join(argv[:4])} … exited {out.returncode}\n{tail}")
    return out


def artifacts_dir() -> Path:
    path = Path(os.environ.get("LOCOSWARM_ARTIFACTS") or ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    if not (path / ".gitignore").exists():
        (path / ".gitignore").write_text("*\n")
    return path


# ---- the engine ---------------------------------------------------------------------------

def ensure_packages() -> None:
    missing = [p for p in DEBIAN_PACKAGES
               if run(["dpkg-query", "-W", "-f=${Status}", p], check=False, capture=True).stdout.strip()
               != "install ok installed"]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise Skip(f"no apt-get to install {', '.join(missing)}")
    log(f"installing {' '.join(missing)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # policy-rc.d: the packages must not start a system dockerd (it would set iptables' FORWARD
    # policy to DROP); this check starts its own, configured not to touch iptables.
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    if added_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        if run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env, check=False,
               capture=True).returncode != 0:
            run(["apt-get", "update", "-q"], env=env, capture=True)
            run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env, capture=True)
    finally:
        if added_policy:
            policy.unlink()


class Engine:
    """A private dockerd: its own socket, data root and exec root; no iptables, no docker0."""

    def __init__(self, data_root: Path, log_path: Path):
        self.data_root, self.log_path = data_root, log_path
        self.proc: subprocess.Popen | None = None
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{SOCKET}", COMPOSE_PROJECT_NAME=PROJECT)
        self.env.pop("DOCKER_CONTEXT", None)
        self.docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"

    def start(self) -> None:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        pidfile = RUN_DIR / "docker.pid"
        if pidfile.exists():  # a previous run of this check died without stopping its daemon
            try:
                old = int(pidfile.read_text().strip())
                if Path(f"/proc/{old}/cmdline").read_bytes().find(str(SOCKET).encode()) >= 0:
                    log(f"stopping the dockerd a previous run left behind (pid {old})")
                    os.kill(old, signal.SIGTERM)
                    for _ in range(60):
                        if not Path(f"/proc/{old}").exists():
                            break
                        time.sleep(0.5)
            except (ValueError, OSError):
                pass
            pidfile.unlink(missing_ok=True)
        argv = ["dockerd", f"--host=unix://{SOCKET}", f"--data-root={self.data_root}",
                f"--exec-root={RUN_DIR / 'exec'}", f"--pidfile={pidfile}", "--iptables=false",
                "--ip-forward=false", "--ip-masq=false", "--bridge=none", "--storage-driver=overlay2"]
        log(f"starting {' '.join(argv)}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-1500:]
                raise Skip(f"dockerd exited with code {self.proc.returncode}; a Docker engine cannot run "
                           f"here. Its log ends:\n{tail}")
            if run([self.docker, "info"], env=self.env, check=False, capture=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            raise Skip("dockerd did not answer within 60 s; a Docker engine cannot run here")
        # Can it run a container at all (cgroups, overlayfs, namespaces)? Checked with the first
        # image we have, below; here the daemon's own view.
        info = run([self.docker, "info", "--format", "{{.ServerVersion}} {{.Driver}} {{.CgroupVersion}}"],
                   env=self.env, capture=True).stdout.strip()
        log(f"dockerd up: version, storage driver, cgroup version = {info}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            log("stopping dockerd")
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # dockerd leaves its namespace bind mount (exec-root/netns/default) behind.
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith(str(RUN_DIR) + "/")]
        for mount in reversed(mounts):
            run(["umount", mount], check=False)
        shutil.rmtree(RUN_DIR, ignore_errors=True)

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return run([self.docker, *args], env=self.env, **kw)


# ---- images -------------------------------------------------------------------------------

def build_base_image(engine: Engine) -> None:
    """A Debian bookworm image with python3.11 (debootstrap + docker import): no registry needed."""
    if engine("image", "inspect", BASE_IMAGE, check=False, capture=True).returncode == 0:
        log(f"base image {BASE_IMAGE} already built (cached in the data root)")
        return
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="locoswarm-rootfs-") as rootfs:
        log("debootstrap bookworm (minbase + python3, venv, pip, ca-certificates, iproute2, libcap2-bin)")
        run(["debootstrap", "--variant=minbase",
             "--include=python3,python3-venv,python3-pip,ca-certificates,iproute2,libcap2-bin",
             "bookworm", rootfs, "http://deb.debian.org/debian"], capture=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        engine("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "-", BASE_IMAGE, stdin=tar.stdout, capture=True)
        tar.wait()
    log(f"base image {BASE_IMAGE} built in {time.monotonic() - start:.0f} s")


def pip_setting(name: str) -> str:
    out = run([sys.executable, "-m", "pip", "config", "get", f"global.{name}"], check=False, capture=True)
    value = out.stdout.strip() if out.returncode == 0 else ""
    return os.environ.get(f"PIP_{name.upper().replace('-', '_')}", value)


def local_torch_wheel() -> Path | None:
    """The torch CPU wheel in pip's find-links folders, if this machine has one."""
    for folder in pip_setting("find-links").split():
        folder = folder.removeprefix("file://")
        for wheel in sorted(Path(folder).glob("torch-2.13.0*cp311*.whl")) if Path(folder).is_dir() else []:
            return wheel
    return None


def build_context(dest: Path) -> list[str]:
    """Copy the project's files (tracked and untracked-but-not-ignored) into ``dest``; fill
    docker/build-extra with what this machine's pip uses. Returns the extra build arguments."""
    files = run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                capture=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file() and not name.startswith("docker/build-extra/"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    extra = dest / "docker" / "build-extra"
    extra.mkdir(parents=True, exist_ok=True)
    args = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    wheel = local_torch_wheel()
    if wheel is not None:
        log(f"torch from the local wheel {wheel}")
        shutil.copy2(wheel, extra / wheel.name)
        args += ["--build-arg", "TORCH_SOURCE=local"]
    cert = pip_setting("cert") or os.environ.get("SSL_CERT_FILE", "")
    if cert and Path(cert).is_file():
        shutil.copy2(cert, extra / "ca.crt")
        args += ["--build-arg", "PIP_CERT=/tmp/build-extra/ca.crt"]
    for name in ("index-url", "extra-index-url"):
        urls = [u for u in pip_setting(name).split() if u.startswith(("http://", "https://"))]
        if urls:
            args += ["--build-arg", f"PIP_{name.upper().replace('-', '_')}={' '.join(urls)}"]
    return args


def build_image(engine: Engine) -> None:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="locoswarm-context-") as ctx:
        args = build_context(Path(ctx))
        log(f"docker build -f docker/Dockerfile {' '.join(args)} -t {IMAGE}")
        out = engine("build", "--network", "host", "-f", "docker/Dockerfile", *args, "-t", IMAGE, ctx,
                     capture=True, check=False)
        (artifacts_dir() / "compose-build.log").write_text(out.stdout)
        if out.returncode != 0:
            raise RuntimeError(f"image build failed:\n{out.stdout[-4000:]}")
    log(f"image {IMAGE} built in {time.monotonic() - start:.0f} s")
    uid = engine("run", "--rm", "--entrypoint", "id", IMAGE, "-u", capture=True).stdout.strip().splitlines()[-1]
    assert uid != "0", "the image must run as a non-root user"
    cuda = engine("run", "--rm", IMAGE, "python", "-c", "import torch; print(torch.version.cuda)",
                  capture=True).stdout.strip().splitlines()[-1]
    assert cuda == "None", f"the CPU image holds a CUDA build of torch (cuda {cuda})"
    log(f"image runs as uid {uid}; torch is the CPU build")


# ---- the swarm ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComposeSwarm:
    def __init__(self, engine: Engine, port: int):
        self.engine, self.port = engine, port
        self.compose = shlex.split(os.environ.get("LOCOSWARM_COMPOSE", "docker-compose"))
        self.env = dict(engine.env, LOCOSWARM_IMAGE=IMAGE, PRESET=os.environ.get("LOCOSWARM_COMPOSE_PRESET", "default"),
                        EVAL_EVERY="1", PEERS=str(PEERS), LOG_FORMAT="json", MONITOR_PORT=str(port),
                        UPLINK_RATE=UPLINK_RATE, THREADS="1")
        self.files = ["-f", str(ROOT / "docker" / "docker-compose.yml"),
                      "-f", str(ROOT / "docker" / "docker-compose.uplink.yml")]
        self.forward_rule: list[str] | None = None

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return run([*self.compose, *self.files, *args], env=self.env, **kw)

    def up(self) -> None:
        self("up", "--no-start", "--no-build", "--scale", f"peer={PEERS}", capture=True)
        self._allow_bridge_forwarding()
        self("up", "-d", "--no-build", "--scale", f"peer={PEERS}", capture=True)

    def _allow_bridge_forwarding(self) -> None:
        """Where bridge netfilter is on and FORWARD drops (another Docker ran here before), let
        the compose bridge forward to itself, with one rule removed again at teardown."""
        nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if not nf.exists() or nf.read_text().strip() != "1" or shutil.which("iptables") is None:
            return
        policy = run(["iptables", "-S", "FORWARD"], capture=True, check=False).stdout.splitlines()
        if "-P FORWARD ACCEPT" in policy:
            return
        net_id = self.engine("network", "inspect", "-f", "{{.Id}}", f"{PROJECT}_default", capture=True).stdout.strip()
        bridge = f"br-{net_id[:12]}"
        self.forward_rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
        run(["iptables", "-I", *self.forward_rule])
        log(f"FORWARD policy is not ACCEPT here: added `iptables -I {' '.join(self.forward_rule)}` until teardown")

    def down(self) -> None:
        try:
            logs = self("logs", "--no-color", "--timestamps", check=False, capture=True).stdout
            (artifacts_dir() / "compose-swarm.log").write_text(logs)
        finally:
            self("down", "-v", "--remove-orphans", "--timeout", "20", check=False, capture=True)
            if self.forward_rule is not None:
                run(["iptables", "-D", *self.forward_rule], check=False)

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service, capture=True).stdout.split()

    def snapshot(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/swarm", timeout=10) as r:
                return json.load(r)
        except (OSError, ValueError):
            return None

    def exited(self) -> list[str]:
        out = self.engine("ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                          "--filter", "status=exited", "--format", "{{.Names}} {{.Status}}", capture=True)
        return [line for line in out.stdout.splitlines() if line.strip()]

    def eval_losses(self) -> dict[str, list[tuple[int, float]]]:
        """Each peer's validation losses (round, loss), from its JSON event lines."""
        out = self("logs", "--no-color", "peer", capture=True, check=False).stdout
        losses: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for line in out.splitlines():
            _, _, text = line.partition("| ")
            try:
                event = json.loads(text)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "eval":
                losses[event["peer_id"]].append((event["round"], event["loss"]))
        return losses


def full_group_rounds(snap: dict) -> dict[str, int]:
    runs = [r for r in snap.get("runs", []) if r["live_peers"]]
    if len(runs) != 1:
        return {}
    return {p["peer_id"]: p["rounds_by_group_size"].get(str(PEERS), 0) for p in runs[0]["peers"] if p["live"]}


def check_swarm(swarm: ComposeSwarm, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    last_report = 0.0
    snap = None
    while True:
        snap = swarm.snapshot()
        counts = full_group_rounds(snap) if snap else {}
        if len(counts) == PEERS and all(n >= ROUNDS_IN_FULL_GROUP for n in counts.values()):
            break
        if time.monotonic() - last_report > 15:
            rounds = {p["peer_id"][-6:]: (p["round"], p["rounds_by_group_size"])
                      for r in (snap or {}).get("runs", []) for p in r["peers"]}
            log(f"waiting: peers (round, rounds by group size) = {rounds or 'none yet'}")
            last_report = time.monotonic()
        exited = swarm.exited()
        if exited:
            raise AssertionError(f"containers exited: {exited}; logs in {artifacts_dir() / 'compose-swarm.log'}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not every peer completed {ROUNDS_IN_FULL_GROUP} rounds in a group of {PEERS} "
                                 f"within {timeout_s:.0f} s; monitor says {counts}")
        time.sleep(2)
    (artifacts_dir() / "compose-monitor.json").write_text(json.dumps(snap, indent=1))
    [run_] = [r for r in snap["runs"] if r["live_peers"]]
    log(f"monitor: {PEERS} live peers, rounds in a group of {PEERS}: {full_group_rounds(snap)}; "
        f"run {run_['run_id']} ({run_['name']})")
    assert run_["live_peers"] == PEERS, run_["live_peers"]

    # The validation loss fell: from the monitor's history where the peers publish it, and from
    # each peer's own eval events (initial φ vs the latest φ) in any case.
    for peer in run_["peers"]:
        history = peer["eval_history"]
        if len(history) >= 2:
            assert history[-1]["loss"] < history[0]["loss"], (peer["peer_id"], history)
            log(f"monitor: {peer['peer_id'][-6:]} validation loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f}")
    losses = swarm.eval_losses()
    assert set(losses) == {p["peer_id"] for p in run_["peers"]}, (sorted(losses), run_["peers"])
    for peer_id, points in losses.items():
        first, last = points[0], points[-1]
        assert last[0] > first[0] and last[1] < first[1], (peer_id, points)
        log(f"peer {peer_id[-6:]}: validation loss {first[1]:.4f} (round {first[0]}) → {last[1]:.4f} (round {last[0]})")

    # The uplink cap is in place in every peer, applied by the non-root entry point.
    for cid in swarm.containers("peer"):
        qdisc = swarm.engine("exec", cid, "tc", "qdisc", "show", "dev", "eth0", capture=True).stdout
        assert "tbf" in qdisc and "rate 200Mbit" in qdisc, qdisc
    log(f"every peer's uplink is capped at {UPLINK_RATE} (tc tbf)")
    return snap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", action="store_true",
                        help="Remove the data root (image cache, ~3 GB) at the end; the default when CI=true.")
    opts = parser.parse_args()
    opts.clean = opts.clean or os.environ.get("CI") == "true"
    start = time.monotonic()
    if os.geteuid() != 0:
        print("SKIPPED compose swarm check: needs root to start dockerd (run as root, as CI does)")
        return 0
    data_root = Path(os.environ.get("LOCOSWARM_DOCKER_ROOT", "/var/lib/locoswarm-ci/docker"))
    engine = Engine(data_root, artifacts_dir() / "dockerd.log")
    swarm = None
    try:
        ensure_packages()
        engine.start()
        build_base_image(engine)
        try:
            engine("run", "--rm", "--network", "none", BASE_IMAGE, "true", capture=True)
        except RuntimeError as exc:
            raise Skip(f"dockerd runs but cannot start a container here: {exc}") from exc
        build_image(engine)
        swarm = ComposeSwarm(engine, free_port())
        log(f"docker-compose up: bootstrap + {PEERS} peers; monitor at http://127.0.0.1:{swarm.port}/")
        swarm.up()
        check_swarm(swarm, float(os.environ.get("LOCOSWARM_COMPOSE_TIMEOUT_S", "600")))
    except Skip as exc:
        print(f"SKIPPED compose swarm check: {exc}")
        return 0
    except (AssertionError, RuntimeError) as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        if swarm is not None:
            swarm.down()
        engine.stop()
        if opts.clean:
            shutil.rmtree(data_root.parent if data_root.parent.name == "locoswarm-ci" else data_root,
                          ignore_errors=True)
        log(f"artifacts in {artifacts_dir()}; total {time.monotonic() - start:.0f} s")
    log(f"PASSED in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
