"""The Docker side of the compose swarm check (tests/docker/compose_swarm.py): Debian's packages, a
private dockerd (own socket, data root and exec root; no iptables rules, no IP forwarding, no
docker0), and the images (a debootstrapped Debian base, then docker/Dockerfile on top).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_DIR = Path("/run/locoswarm-ci")
SOCKET = RUN_DIR / "docker.sock"
BASE_IMAGE = "locoswarm-base:bookworm"
IMAGE = "locoswarm:ci"
PROJECT = "locoswarm-ci"
DEBIAN_PACKAGES = ("docker.io", "docker-compose", "debootstrap", "iptables")


class Skip(Exception):
    """A Docker engine cannot run here; the message says why."""


def log(msg: str) -> None:
    print(f"[compose-swarm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(
    argv: list[str],
    *,
    env: dict | None = None,
    check: bool = True,
    capture: bool = False,
    timeout: float | None = None,
    **kw,
) -> subprocess.CompletedProcess:
    out = subprocess.run(
        argv,
        env=env,
        text=True,
        timeout=timeout,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        **kw,
    )
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
    missing = [
        p
        for p in DEBIAN_PACKAGES
        if run(["dpkg-query", "-W", "-f=${Status}", p], check=False, capture=True).stdout.strip()
        != "install ok installed"
    ]
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
        if (
            run(
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                env=env,
                check=False,
                capture=True,
            ).returncode
            != 0
        ):
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
        argv = [
            "dockerd",
            f"--host=unix://{SOCKET}",
            f"--data-root={self.data_root}",
            f"--exec-root={RUN_DIR / 'exec'}",
            f"--pidfile={pidfile}",
            "--iptables=false",
            "--ip-forward=false",
            "--ip-masq=false",
            "--bridge=none",
            "--storage-driver=overlay2",
        ]
        log(f"starting {' '.join(argv)}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-1500:]
                raise Skip(
                    f"dockerd exited with code {self.proc.returncode}; a Docker engine cannot run "
                    f"here. Its log ends:\n{tail}"
                )
            if run([self.docker, "info"], env=self.env, check=False, capture=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            raise Skip("dockerd did not answer within 60 s; a Docker engine cannot run here")
        # Can it run a container at all (cgroups, overlayfs, namespaces)? Checked with the first
        # image we have, below; here the daemon's own view.
        info = run(
            [self.docker, "info", "--format", "{{.ServerVersion}} {{.Driver}} {{.CgroupVersion}}"],
            env=self.env,
            capture=True,
        ).stdout.strip()
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
        mounts = [
            line.split()[1]
            for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(RUN_DIR) + "/")
        ]
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
        run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,python3-pip,ca-certificates,iproute2,libcap2-bin",
                "bookworm",
                rootfs,
                "http://deb.debian.org/debian",
            ],
            capture=True,
        )
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        engine(
            "import",
            "--change",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "-",
            BASE_IMAGE,
            stdin=tar.stdout,
            capture=True,
        )
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
    files = run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture=True
    ).stdout.split("\0")
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
        out = engine(
            "build", "--network", "host", "-f", "docker/Dockerfile", *args, "-t", IMAGE, ctx, capture=True, check=False
        )
        (artifacts_dir() / "compose-build.log").write_text(out.stdout)
        if out.returncode != 0:
            raise RuntimeError(f"image build failed:\n{out.stdout[-4000:]}")
    log(f"image {IMAGE} built in {time.monotonic() - start:.0f} s")
    uid = engine("run", "--rm", "--entrypoint", "id", IMAGE, "-u", capture=True).stdout.strip().splitlines()[-1]
    assert uid != "0", "the image must run as a non-root user"
    cuda = (
        engine("run", "--rm", IMAGE, "python", "-c", "import torch; print(torch.version.cuda)", capture=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert cuda == "None", f"the CPU image holds a CUDA build of torch (cuda {cuda})"
    log(f"image runs as uid {uid}; torch is the CPU build")
