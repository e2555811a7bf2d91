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
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peer.events import Event
from tests.docker.engine import (
    BASE_IMAGE,
    IMAGE,
    PROJECT,
    ROOT,
    Engine,
    Skip,
    artifacts_dir,
    build_base_image,
    build_image,
    ensure_packages,
    log,
    run,
)

PEERS = 3
ROUNDS_IN_FULL_GROUP = 2
UPLINK_RATE = "200mbit"


# ---- the swarm ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComposeSwarm:
    def __init__(self, engine: Engine, port: int):
        self.engine, self.port = engine, port
        self.compose = shlex.split(os.environ.get("LOCOSWARM_COMPOSE", "docker-compose"))
        self.env = dict(
            engine.env,
            LOCOSWARM_IMAGE=IMAGE,
            PRESET=os.environ.get("LOCOSWARM_COMPOSE_PRESET", "default"),
            EVAL_EVERY="1",
            PEERS=str(PEERS),
            LOG_FORMAT="json",
            MONITOR_PORT=str(port),
            UPLINK_RATE=UPLINK_RATE,
            THREADS="1",
        )
        self.files = [
            "-f",
            str(ROOT / "docker" / "docker-compose.yml"),
            "-f",
            str(ROOT / "docker" / "docker-compose.uplink.yml"),
        ]
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
        out = self.engine(
            "ps",
            "-a",
            "--filter",
            f"label=com.docker.compose.project={PROJECT}",
            "--filter",
            "status=exited",
            "--format",
            "{{.Names}} {{.Status}}",
            capture=True,
        )
        return [line for line in out.stdout.splitlines() if line.strip()]

    def eval_losses(self) -> dict[str, list[tuple[int, float]]]:
        """Each peer's validation losses (round, loss), from its JSON event lines."""
        out = self("logs", "--no-color", "peer", capture=True, check=False).stdout
        losses: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for line in out.splitlines():
            event = Event.parse(line.partition("| ")[2])
            if event is not None and event.kind == "eval":
                losses[event["peer_id"]].append((event.round, event["loss"]))
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
            rounds = {
                p["peer_id"][-6:]: (p["round"], p["rounds_by_group_size"])
                for r in (snap or {}).get("runs", [])
                for p in r["peers"]
            }
            log(f"waiting: peers (round, rounds by group size) = {rounds or 'none yet'}")
            last_report = time.monotonic()
        exited = swarm.exited()
        if exited:
            raise AssertionError(f"containers exited: {exited}; logs in {artifacts_dir() / 'compose-swarm.log'}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not every peer completed {ROUNDS_IN_FULL_GROUP} rounds in a group of {PEERS} "
                f"within {timeout_s:.0f} s; monitor says {counts}"
            )
        time.sleep(2)
    (artifacts_dir() / "compose-monitor.json").write_text(json.dumps(snap, indent=1))
    [run_] = [r for r in snap["runs"] if r["live_peers"]]
    log(
        f"monitor: {PEERS} live peers, rounds in a group of {PEERS}: {full_group_rounds(snap)}; "
        f"run {run_['run_id']} ({run_['name']})"
    )
    assert run_["live_peers"] == PEERS, run_["live_peers"]

    # The validation loss fell: from the monitor's history where the peers publish it, and from
    # each peer's own eval events (initial φ vs the latest φ) in any case.
    for peer in run_["peers"]:
        history = peer["eval_history"]
        if len(history) >= 2:
            assert history[-1]["loss"] < history[0]["loss"], (peer["peer_id"], history)
            log(f"monitor: {peer['peer_id'][-6:]} validation loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f}")
    # Every peer evaluates φ at its start; after that one peer per cadence round evaluates for the
    # swarm (peer/round/), so the fall is read from all peers' evaluations together.
    losses = swarm.eval_losses()
    assert set(losses) == {p["peer_id"] for p in run_["peers"]}, (sorted(losses), run_["peers"])
    pooled = sorted(point for points in losses.values() for point in points)
    first, last = pooled[0], pooled[-1]
    assert last[0] > first[0] and last[1] < first[1], pooled
    log(
        f"swarm: validation loss {first[1]:.4f} (round {first[0]}) → {last[1]:.4f} (round {last[0]}), "
        f"{len(pooled)} evaluations by {len(losses)} peers"
    )

    # The uplink cap is in place in every peer, applied by the non-root entry point.
    for cid in swarm.containers("peer"):
        qdisc = swarm.engine("exec", cid, "tc", "qdisc", "show", "dev", "eth0", capture=True).stdout
        assert "tbf" in qdisc and "rate 200Mbit" in qdisc, qdisc
    log(f"every peer's uplink is capped at {UPLINK_RATE} (tc tbf)")
    return snap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clean",
        action="store_true",
        help="Remove the data root (image cache, ~3 GB) at the end; the default when CI=true.",
    )
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
            shutil.rmtree(
                data_root.parent if data_root.parent.name == "locoswarm-ci" else data_root, ignore_errors=True
            )
        log(f"artifacts in {artifacts_dir()}; total {time.monotonic() - start:.0f} s")
    log(f"PASSED in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
