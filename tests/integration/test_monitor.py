"""The swarm monitor against a real local swarm: JSON, Prometheus metrics, and the page as a real
headless browser (Debian's chromium) renders it, with a screenshot kept as an artifact."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from peer.launch import bootstrap_argv
from tests.integration.harness import PROJECT_ROOT, make_manifest, write_manifest

pytestmark = pytest.mark.integration

ROUNDS = 12


def artifacts_dir() -> Path:
    """$LOCOSWARM_ARTIFACTS, or tests/artifacts (kept out of git by a ``*`` .gitignore inside it)."""
    path = Path(os.environ.get("LOCOSWARM_ARTIFACTS") or PROJECT_ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    ignore = path / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    return path


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no chromium on PATH: `apt-get install chromium` (.ci/run installs it)")


def browser(url: str, *args: str, workdir: Path) -> str:
    """Run headless chromium on ``url``; returns stdout. ``--virtual-time-budget`` lets the page's
    script run (first render and one refresh) before the DOM is dumped or the screenshot taken."""
    argv = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={workdir / 'chromium-profile'}",
        "--virtual-time-budget=3000",
        *args,
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"chromium exited {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout


class PeerRows(HTMLParser):
    """Cells of every ``<tr class="peer" data-peer-id=...>`` in a rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self._peer: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "peer":
            self._peer = a["data-peer-id"]
            self.rows[self._peer] = []
        elif tag == "td" and self._peer is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self._peer is not None:
            self.rows[self._peer].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr":
            self._peer = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def consistent_metrics(base: str, run_id: str, attempts: int) -> tuple[dict, str]:
    """The run's JSON and the /metrics text read while the monitor's view of the run did not change
    (the same snapshot before and after the metrics were read); at most ``attempts`` tries."""

    def view(snap: dict) -> dict:
        return next(r for r in snap["runs"] if r["run_id"] == run_id)

    def records(run: dict) -> list:  # what the metrics are made of (``last_seen`` moves on every poll)
        return [(p["peer_id"], p["live"], p["round"], p["published_at"], p["last_sync"]) for p in run["peers"]]

    for _ in range(attempts):
        before = view(json.loads(get(base + "api/swarm")[1]))
        status, text = get(base + "metrics")
        assert status == 200, (status, text)
        after = view(json.loads(get(base + "api/swarm")[1]))
        if records(before) == records(after):
            return after, text
        time.sleep(0.5)
    pytest.fail(f"the monitor's view of the run changed around each of {attempts} reads of /metrics")


def wait_snapshot(base: str, predicate, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    snap: dict = {}
    while time.monotonic() < deadline:
        snap = json.loads(get(base + "api/swarm")[1])
        if predicate(snap):
            return snap
        time.sleep(0.5)
    brief = [
        {
            "run_id": r["run_id"],
            "peers": [{k: p[k] for k in ("peer_id", "live", "round", "group_size")} for p in r["peers"]],
        }
        for r in snap.get("runs", [])
    ]
    raise AssertionError(f"the monitor never showed the expected state; last snapshot: {json.dumps(brief)}")


def test_monitor_shows_a_running_swarm(procs, tmp_path):
    manifest = make_manifest()
    run_file = write_manifest(tmp_path, manifest)
    boot = procs.spawn(
        "bootstrap",
        bootstrap_argv(
            identity=tmp_path / "bootstrap.key", run=run_file, extra=["--monitor-port", "0", "--monitor-poll", "0.5"]
        ),
    )
    ready = boot.wait_event(lambda e: e.kind == "ready", 60)
    addr = ready.addresses_on("127.0.0.1")[0]
    base = ready["monitor_url"]
    assert base.startswith("http://127.0.0.1:")
    status, body = get(base + "healthz")
    assert (status, body) in ((200, "ok\n"), (503, "starting\n"))

    peers = [
        procs.peer(
            f"peer-{i}",
            "--initial-peers",
            addr,
            "--max-rounds",
            str(ROUNDS),
            "--eval-every",
            "1",
            "--wait-for-peers",
            "3",
            # peer-0 is a volunteer with its own caps (issue #53 item 10): its row shows its use against them
            *(["--max-upload-mbit", "50", "--max-gb-per-day", "5"] if i == 0 else []),
        )
        for i in range(3)
    ]
    started = [p.wait_event(lambda e: e.kind == "started", 120) for p in peers]
    ids = {e["peer_id"] for e in started}
    capped_id = started[0]["peer_id"]
    # the device each peer said it trains on, as the monitor's row shows it (peer/net/devices.py)
    devices = {e["peer_id"]: f"cpu {e['device_name']} {e['precision']}" for e in started}

    # While the peers train: every one of them is on the page, as the browser renders it.
    def all_training(snap):
        run = next((r for r in snap["runs"] if r["run_id"] == manifest.run_id), None)
        return run is not None and {p["peer_id"] for p in run["peers"] if p["live"] and p["round"] >= 1} == ids

    wait_snapshot(base, all_training, 120)
    assert get(base + "healthz") == (200, "ok\n")
    rows = PeerRows()
    rows.feed(browser(base, "--dump-dom", workdir=tmp_path))
    assert set(rows.rows) == ids, f"rendered rows {sorted(rows.rows)} != peers {sorted(ids)}"
    for peer_id, cells in rows.rows.items():
        assert cells[1] == "live", cells
        assert cells[2] in (devices[peer_id], "–"), cells  # the device column ("–" until its record is read)
        assert int(cells[3]) >= 1, cells  # the round column
        # the caps column: "upload 0.4/50 Mbit/s, today 0.00/5 GB" for the capped peer, "–" for the others
        if peer_id == capped_id:
            assert re.fullmatch(r"upload \d+\.\d/50 Mbit/s, today \d+\.\d\d/5 GB", cells[11]), cells
        else:
            assert cells[11] == "–", cells
    # the device records are read within a poll or two of a peer's first record
    snap = wait_snapshot(
        base,
        lambda s: all(p.get("device") for r in s["runs"] if r["run_id"] == manifest.run_id for p in r["peers"]),
        60,
    )
    shown = {p["peer_id"]: p["device"] for r in snap["runs"] if r["run_id"] == manifest.run_id for p in r["peers"]}
    assert shown == devices, shown
    shot = artifacts_dir() / "monitor.png"
    shot.unlink(missing_ok=True)
    browser(base, f"--screenshot={shot}", "--window-size=1280,1000", "--hide-scrollbars", workdir=tmp_path)
    assert shot.stat().st_size > 10_000
    print(f"monitor screenshot: {shot}")

    # After the last round: the monitor says what each peer itself reported. (A peer's very last
    # record can be lost: it is stored without waiting just before the peer leaves the DHT.)
    events, evals = {}, {}
    for p in peers:
        stopped = p.wait_event(lambda e: e.kind == "stopped", 240)
        assert p.wait(60) == 0, p.tail()
        events[stopped["peer_id"]] = {e["round"]: e for e in p.of("round")}
        evals[stopped["peer_id"]] = {e["round"]: e["loss"] for e in p.of("eval")}
    # φ is evaluated on the cadence (--eval-every 1) by one peer per round, not by all three.
    evaluators = Counter(e["round"] for p in peers for e in p.of("eval") if e["when"] == "periodic")
    assert evaluators and max(evaluators.values()) < 3, evaluators
    done = wait_snapshot(
        base,
        lambda s: (
            sorted(p["round"] >= ROUNDS - 1 for r in s["runs"] if r["run_id"] == manifest.run_id for p in r["peers"])
            == [True] * 3
        ),
        60,
    )
    run = next(r for r in done["runs"] if r["run_id"] == manifest.run_id)
    assert run["name"] == manifest.name and run["inner_steps"] == manifest.sync.inner_steps
    assert run["live_peers"] == 3 and run["max_round"] >= ROUNDS - 1
    # Liveness by record age (protocol/liveness.py): the peers' last records are fresh, and the
    # swarm's throughput is the live peers' sum.
    for peer in run["peers"]:
        assert peer["live"] and 0 < peer["stale_after_s"] and peer["published_at"] <= done["generated_at"] + 5, peer
    assert run["tokens_per_s"] == pytest.approx(sum(p["tokens_per_s"] for p in run["peers"]))
    H = manifest.sync.inner_steps
    for peer in run["peers"]:
        reported = events[peer["peer_id"]]
        # Every group size the monitor kept for a round is the one the peer reported for it.
        assert peer["group_by_round"], peer
        for round_, size in peer["group_by_round"].items():
            assert size == reported[int(round_)]["group_size"], (peer["peer_id"], round_, size)
        assert sum(peer["rounds_by_group_size"].values()) == len(peer["group_by_round"])
        # Every round since the first one seen is either counted by group size or counted as unseen.
        seen_after = sum(1 for r in peer["group_by_round"] if int(r) > peer["first_round"])
        assert seen_after + peer["rounds_unseen"] == peer["round"] - peer["first_round"], peer
        if peer["inner_step"] == peer["round"] * H:  # the record written right after a sync
            event = reported[peer["round"]]
            assert (peer["group_size"], peer["bytes_sent"]) == (event["group_size"], event["bytes_sent"])
            assert peer["train_loss"] == pytest.approx(event["train_loss"])
        assert peer["first_seen"] <= peer["last_seen"]
        # Every validation loss on the page is one the peer evaluated at that round.
        for point in peer["eval_history"]:
            assert point["loss"] == pytest.approx(evals[peer["peer_id"]][point["round"]]), (peer["peer_id"], point)
        steps = [h["inner_step"] for h in peer["history"]]
        assert steps == sorted(steps) and len(steps) >= 2

    from prometheus_client.parser import text_string_to_metric_families

    # The metrics and the JSON are two reads of a monitor that keeps polling (a peer's last record can
    # arrive after `done`): compare them only as read between two snapshots that agree.
    run, text = consistent_metrics(base, manifest.run_id, 120)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("locoswarm_live_peers", (("run_id", manifest.run_id),))] == 3
    assert samples[("locoswarm_swarm_tokens_per_second", (("run_id", manifest.run_id),))] > 0
    for peer in run["peers"]:
        labels = (("peer_id", peer["peer_id"]), ("run_id", manifest.run_id))
        assert samples[("locoswarm_peer_round", labels)] == peer["round"]
        sync = peer["last_sync"]
        assert sync == {
            "round": max(map(int, peer["group_by_round"])),
            "group_size": peer["group_by_round"][str(sync["round"])],
            "bytes_sent": events[peer["peer_id"]][sync["round"]]["bytes_sent"],
            "bytes_received": sync["bytes_received"],
        }
        assert samples[("locoswarm_peer_group_size", labels)] == sync["group_size"]
        assert samples[("locoswarm_peer_round_bytes_sent", labels)] == sync["bytes_sent"]


def test_monitor_command_serves_a_swarm_it_does_not_host(procs, tmp_path):
    """`bootstrap monitor` joins as a DHT client and finds the peers' records."""
    manifest = make_manifest()
    run_file = write_manifest(tmp_path, manifest)
    _, addr = procs.bootstrap(run_file)
    peer = procs.peer("peer-0", "--initial-peers", addr, "--max-rounds", "2")
    peer_id = peer.wait_event(lambda e: e.kind == "started", 120)["peer_id"]
    mon = procs.spawn(
        "monitor",
        [
            sys.executable,
            "-m",
            "bootstrap",
            "monitor",
            "--initial-peers",
            addr,
            "--port",
            "0",
            "--poll",
            "0.5",
            "--log-format",
            "json",
        ],
    )
    base = mon.wait_event(lambda e: e.kind == "ready", 60)["monitor_url"]
    snap = wait_snapshot(
        base, lambda s: any(p["peer_id"] == peer_id and p["round"] >= 1 for r in s["runs"] for p in r["peers"]), 120
    )
    assert [r["run_id"] for r in snap["runs"]] == [manifest.run_id]
    status, page = get(base)
    assert status == 200 and "swarm monitor" in page
    assert manifest.run_id in page  # the embedded snapshot
    assert get(base + "nope")[0] == 404


def page_snapshot(now: float) -> dict:
    """A snapshot shaped as ``SwarmMonitor.snapshot`` makes it, with the widest cells a swarm can have:
    a long device name, caps, many group sizes, unseen rounds; peers at rounds 12, 12 and 40 (one capped
    peer alone ahead); peer 0 evaluated at its round, peer 1 at round 0 only."""

    def peer(i: int, round_: int, evals: list[tuple[int, float]]) -> dict:
        return {
            "peer_id": f"12D3KooWPeer{i}" + "x" * 40,
            "live": True,
            "device": "cuda:0 (NVIDIA GeForce RTX 4090 Laptop GPU with a very long name, 16.0 GiB, sm 8.9, bf16, "
            "micro-batch 8 of 64, compiled)",
            "caps": "upload 4.8/5 Mbit/s, today 1.20/2 GB, 3 syncs with a stronger codec, 2 rounds sat out",
            "first_seen": now - 600,
            "last_seen": now,
            "last_change": now,
            "published_at": now - 3,
            "stale_after_s": 120.0,
            "round": round_,
            "inner_step": round_ * 1000 + 999,
            "train_loss": 2.913,
            "tokens_per_s": 1234567.0,
            "group_size": 12,
            "bytes_sent": 987654321,
            "bytes_received": 987654321,
            "eval_loss": evals[-1][1],
            "eval_round": evals[-1][0],
            "last_sync": {"round": round_, "group_size": 12, "bytes_sent": 987654321, "bytes_received": 987654321},
            "rounds_by_group_size": {str(g): 10 + g for g in range(1, 13)},
            "first_round": 0,
            "rounds_unseen": 123,
            "group_by_round": {},
            "eval_history": [{"round": r, "t": now - 600 + 10 * r, "loss": loss} for r, loss in evals],
            "history": [],
        }

    peers = [peer(0, 12, [(0, 5.7025), (12, 2.4113)]), peer(1, 12, [(0, 5.7025)]), peer(2, 40, [(0, 5.7025)])]
    run = {
        "run_id": "ab" * 32,
        "name": "a run with a rather long name, as an owner may choose",
        "inner_steps": 500,
        "live_peers": 3,
        "median_round": 12,
        "max_round": 40,
        "tokens_per_s": 3 * 1234567.0,
        "live_by_group_size": {"2": 1, "12": 2},
        "peers": peers,
    }
    return {"generated_at": now, "started_at": now - 600, "last_poll": now, "last_error": None, "runs": [run]}


def test_the_page_fits_a_1280_px_window_and_says_what_each_loss_and_round_is(tmp_path):
    """Issue #68 item 6, as a browser renders the page: nothing wider than a 1,280 px window (no
    horizontal scroll); each validation loss with its round, an old one greyed; the swarm's round is
    the live peers' median, the maximum beside it."""
    from bootstrap.monitor_page import render_page

    page = render_page("locoswarm", json.dumps(page_snapshot(time.time())))
    measure = (
        "<script>window.addEventListener('load', () => { document.body.dataset.scrollWidth = "
        "document.documentElement.scrollWidth; document.body.dataset.innerWidth = window.innerWidth; "
        "document.body.dataset.tableScrolls = [...document.querySelectorAll('.tablebox')]"
        ".some(b => b.scrollWidth > b.clientWidth); });</script>"
    )
    path = tmp_path / "monitor.html"
    path.write_text(page.replace("</body>", measure + "</body>"))
    dom = browser(path.as_uri(), "--dump-dom", "--window-size=1280,1000", "--hide-scrollbars", workdir=tmp_path)
    widths = re.search(r'<body data-scroll-width="(\d+)" data-inner-width="(\d+)" data-table-scrolls="(\w+)"', dom)
    assert widths, dom[:2000]
    scroll_width, inner_width = int(widths.group(1)), int(widths.group(2))
    assert inner_width == 1280, inner_width  # the window the page was laid out in
    assert scroll_width <= 1280, f"the page is {scroll_width} px wide in a 1,280 px window"
    assert widths.group(3) == "false", "the table fits only by scrolling inside its box"

    rows = PeerRows()
    rows.feed(dom)
    cells = {peer_id[:13]: row for peer_id, row in rows.rows.items()}
    assert cells["12D3KooWPeer0"][6] == "2.4113 @ r12", cells
    assert cells["12D3KooWPeer1"][6] == "5.7025 @ r0" and cells["12D3KooWPeer2"][6] == "5.7025 @ r0", cells
    stale = re.findall(
        r'<td class="stale" title="measured at round 0; the peer is at round (\d+)">5\.7025 @ r0</td>', dom
    )
    assert sorted(stale) == ["12", "40"], dom  # greyed: older than the peer's round
    assert "2.4113 @ r12</td>" in dom and '<td class="stale" title="measured at round 12' not in dom
    card = re.search(r'<div class="v">([^<]*)</div><div class="k">median round of live peers \(max (\d+)\)</div>', dom)
    assert card and card.groups() == ("12", "40"), dom  # the median, not the lone peer ahead
    assert '<div class="v">2.4113 @ r12</div><div class="k">validation loss of φ</div>' in dom
