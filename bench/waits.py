"""Stopwatch on the lines real processes print where a person waits (issue #53 item 4).

Starts, on this machine, with text output as a person sees it:

1. ``bootstrap run`` (default run, a fresh identity): seconds to its first line, to its address
   line, and the longest silence between two lines;
2. ``bootstrap monitor`` against it: seconds to its first line and to the page's address;
3. ``peer join`` against it (a fresh data dir): seconds to each line up to its first round, the
   longest silence, then, ``--stop-at`` of a round after a round line (mid-round, where a Ctrl-C at a
   random moment lands on average), SIGINT: seconds from the "stopped" line to the process's exit;
4. ``peer join`` again on the same data dir (a restart): seconds to its first round, the longest
   silence, any warning line, and where it trained from (the inner step its checkpoint resumed at,
   the step it started training at: the swarm's when it joined it there);
5. (issue #68 item 4) ``peer status`` and ``peer doctor --initial-peers`` against the bootstrap node,
   piped (each to its exit), and ``peer swarm`` (the default: 3 peers, to its first round line): the
   longest silence of each, under ``commands``.

Prints a table and writes bench/results/waits.json: ``bootstrap_first_line_s``,
``bootstrap_ready_s``, ``monitor_first_line_s``, ``monitor_ready_s``, ``join_first_line_s``,
``join_read_data_s`` (hashing, at first tokenizing, the corpus), ``join_started_s``,
``join_first_step_s`` (its line saying where it trains from, right before its first inner step),
``join_first_round_s``, ``join_longest_silence_s``, ``sigint_stopped_to_exit_s``,
``sigint_to_stopped_s`` (the signal to that line: the inner step under way, the checkpoint written),
``restart_first_line_s``, ``restart_read_data_s``, ``restart_started_s``, ``restart_first_step_s``
(issue #53's "a restart trains its first round within 15 s": its first inner step),
``restart_first_round_s``, ``restart_longest_silence_s``, ``restart_warnings`` (its warning, error and
traceback lines up to its first round; with ``--second-peer`` also ``restart_other_peer_warnings``, the
other peer's meanwhile), ``stop_at`` (the fraction of a round after a round line at which the SIGINT
came), ``restart_resumed_step`` (the inner step its checkpoint resumed at), ``restart_training_step``
(where its first inner step started: the swarm's step when it joined it there or adopted its state),
``restart_how`` (``resumed``, ``joined the swarm's step`` or ``adopted the swarm's state``), with
``--second-peer`` ``restart_swarm_sync_s`` (from the restart's command to the other peer's next round
line: the swarm's next sync, which no restart can sync before) and ``restart_swarm_syncs_missed``
(the other peer's rounds that ended after that command and before the restart's first round: 0 when
the restart synced with the swarm's next sync) and ``restart_first_sync_s`` with
``restart_first_sync_line`` (its first round line with a group of two or more: issue #68's "restart
to first sync"), ``command``, ``device``, ``load_average_start`` and
``load_average_end`` (the machine's 1-minute load average: other jobs slow a niced bench's peers
down, their rounds most), and
``commands``: per command (``bootstrap run``, ``peer status``, ``peer doctor``, ``peer join``, ``peer
join (restart)``, ``peer swarm``) ``longest_silence_s`` (the longest gap between two lines on its
stdout and stderr together, from its start to its first round line, its address line for ``bootstrap
run``, or its exit), ``first_line_s``, ``longest_silence_after_first_line_s``, ``until`` (which),
``until_s``, ``after`` (the line before that gap) and ``load_average`` (1-minute, when it ended);
``results_note`` says the machine's load.

    nice .venv/bin/python bench/waits.py [--fresh-cache] [--second-peer] [--stop-at 0.5] [--out bench/results/waits.json]

``--second-peer`` keeps a second peer training while the first stops and restarts (the restart then
catches up with a swarm). ``--fresh-cache`` points LOCOSWARM_CACHE_DIR at an empty directory, as on a fresh clone.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is repo tooling
from bench.provenance import git_commit  # noqa: E402

FIRST_STEP = r"^(training from round \d+, inner step \d+ of \d+|eval \(initial\) at round \d+)"
"""The line after which a peer's first inner step starts: the one saying where it trains from (on a
CPU its initial evaluation of φ then runs alongside); before that line existed, its initial evaluation's."""
READING_DATA = r"^reading the (data of run|run's data)"
WARNING = re.compile(r"warn|error|traceback", re.IGNORECASE)
ROUND = r"^round \d+ \|"


class Watched:
    """A process whose stdout and stderr lines are stamped with seconds since its start."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name = name
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        self.lines: list[tuple[float, str, str]] = []
        self.sigint_to_stopped_s = 0.0
        """Set by :meth:`sigint_and_time_exit`."""
        self.q: queue.Queue[tuple[float, str, str]] = queue.Queue()
        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._read, args=(name, stream), daemon=True).start()

    def _read(self, name, stream) -> None:
        for line in stream:
            item = (time.monotonic() - self.t0, name, line.rstrip("\n"))
            self.lines.append(item)
            self.q.put(item)
            print(f"  {self.name:9} {item[0]:7.2f} s [{name}] {item[2][:150]}", flush=True)

    def wait_for(self, pattern: str, timeout_s: float = 300.0) -> float:
        """Seconds since start at which a line matching ``pattern`` appeared (waits for it)."""
        rx = re.compile(pattern)
        for t, _, line in list(self.lines):
            if rx.search(line):
                return t
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                t, _, line = self.q.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if rx.search(line):
                return t
        raise SystemExit(f"no line matching {pattern!r} within {timeout_s} s")

    def round_line_after(self, since_s: float, timeout_s: float = 300.0) -> float:
        """Seconds since start of its first round line after ``since_s`` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, _, line in list(self.lines):
                if t > since_s and re.match(ROUND, line):
                    return t
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise SystemExit(f"{self.name}: no round line after {since_s:.1f} s within {timeout_s} s")

    def first_line_s(self) -> float:
        return self.lines[0][0]

    def step_s(self, pattern: str) -> float:
        """Seconds from the first line matching ``pattern`` to the line after it (how long that step took)."""
        rx = re.compile(pattern)
        i = next(k for k, (_, _, line) in enumerate(self.lines) if rx.search(line))
        after = next(t for t, _, line in self.lines[i + 1 :] if not line.startswith("still "))  # not its ticker
        return after - self.lines[i][0]

    def longest_silence(self, until_s: float, *, to_end: bool = False) -> tuple[float, str]:
        """The longest gap between two lines (from the start) up to ``until_s``, and the line before it;
        with ``to_end``, the gap from the last line to ``until_s`` (the process's exit) counts too."""
        best, before, last = 0.0, "(start)", 0.0
        prev_line = "(start)"
        for t, _, line in self.lines:
            if t > until_s:
                break
            if t - last > best:
                best, before = t - last, prev_line
            last, prev_line = t, line
        if to_end and until_s - last > best:
            best, before = until_s - last, prev_line + " (then the exit)"
        return best, before

    def wait_exit(self, timeout_s: float = 600.0) -> float:
        """Seconds since start at which the process exited (waits for it and for its output)."""
        self.proc.wait(timeout_s)
        t = time.monotonic() - self.t0
        time.sleep(0.2)  # the readers take the last lines
        return t

    def sigint_and_time_exit(self) -> float:
        """SIGINT to the process; seconds from its "stopped" line to its exit (and in
        :attr:`sigint_to_stopped_s`, from the signal to that line: the inner step under way and the
        checkpoint's write)."""
        t_signal = time.monotonic() - self.t0
        self.proc.send_signal(signal.SIGINT)
        t_stop = self.wait_for(r"^stopped after", 120)
        self.sigint_to_stopped_s = t_stop - t_signal
        self.proc.wait(120)
        return time.monotonic() - self.t0 - t_stop

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def startup_figures(prefix: str, peer: Watched) -> dict:
    """Seconds from a peer's start to its first round, first line, start line, first inner step and
    data read, and its longest silence before the first round, keyed ``<prefix>_...``."""
    first_round = peer.wait_for(r"^round \d+ \|", 600)
    silence, after = peer.longest_silence(first_round)
    return {
        f"{prefix}_first_round_s": first_round,
        f"{prefix}_first_line_s": peer.first_line_s(),
        f"{prefix}_started_s": peer.wait_for(r"^locoswarm .* \| peer "),
        f"{prefix}_first_step_s": peer.wait_for(FIRST_STEP),
        f"{prefix}_read_data_s": peer.step_s(READING_DATA),
        f"{prefix}_longest_silence_s": silence,
        f"{prefix}_longest_silence_after": after,
    }


def first_sync_s(peer: Watched, timeout_s: float = 300.0) -> tuple[float, str]:
    """Seconds since start of the peer's first round line with a group of two or more (its first
    sync with the swarm), and that line (waits for it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for t, _, line in list(peer.lines):
            if re.match(ROUND, line) and (m := re.search(r"\| group (\d+) \|", line)) and int(m.group(1)) >= 2:
                return t, line
        if peer.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit(f"{peer.name}: no round synced with a group within {timeout_s} s")


def round_number(line: str) -> int:
    """The round a ``round N | ...`` line reports."""
    return int(line.split()[1])


def where_it_trained(peer: Watched) -> dict:
    """Where a restarted peer trained from: the inner step its checkpoint resumed at, the step its
    first inner step started at, and how it got there (resumed, joined the swarm's step, adopted)."""
    lines = [line for _, _, line in peer.lines]
    resumed = next((m for line in lines if (m := re.search(r"^resumed from checkpoint .* step (\d+) of", line))), None)
    start = next(m for line in lines if (m := re.search(r"^training from round \d+, inner step (\d+) of", line)))
    how = (
        "adopted the swarm's state"
        if any(line.startswith("re-synced at round") for line in lines)
        else "joined the swarm's step"
        if any("joining it there from step" in line for line in lines)
        else "resumed"
    )
    return {
        "restart_resumed_step": int(resumed.group(1)) if resumed else None,
        "restart_training_step": int(start.group(1)),
        "restart_how": how,
    }


def silence(cmd: Watched, until: str, until_s: float, *, to_end: bool = False) -> dict:
    """A command's longest silence up to ``until_s`` (its line ``until``, or its exit with ``to_end``),
    and apart, the longest once its first line is out (the wait before it is Python importing the CLI)."""
    gap, after = cmd.longest_silence(until_s, to_end=to_end)
    first = cmd.first_line_s()
    times = [t for t, _, _ in cmd.lines if t <= until_s]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)] + ([until_s - times[-1]] if to_end and times else [])
    return {
        "longest_silence_s": round(gap, 2),
        "first_line_s": round(first, 2),
        "longest_silence_after_first_line_s": round(max(gaps, default=0.0), 2),
        "after": after,
        "until": until,
        "until_s": round(until_s, 2),
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh-cache", action="store_true")
    ap.add_argument("--second-peer", action="store_true", help="a second peer trains while the first restarts")
    ap.add_argument(
        "--stop-at",
        type=float,
        default=0.5,
        help="SIGINT to the first peer this fraction of its last round's length after a round line (0: at once)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "waits.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout's SIGTERM still stops the children
    bin_dir = Path(sys.executable).parent
    tmp = Path(tempfile.mkdtemp(prefix="waits-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    if args.fresh_cache:
        env["LOCOSWARM_CACHE_DIR"] = str(tmp / "cache")
    r: dict = {
        "commit": git_commit(ROOT),
        "device": f"{os.cpu_count()}-core CPU, no GPU",
        "command": " ".join(["python", "bench/waits.py", *sys.argv[1:]]),
        "load_average_start": os.getloadavg()[0],
    }
    procs: list[Watched] = []
    try:
        print("bootstrap run")
        boot = Watched(
            "bootstrap",
            [str(bin_dir / "bootstrap"), "run", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp / "b.key")],
            env,
        )
        procs.append(boot)
        r["bootstrap_ready_s"] = boot.wait_for(r"peer join --initial-peers /ip4/127\.0\.0\.1/")
        r["bootstrap_first_line_s"] = boot.first_line_s()
        commands = r["commands"] = {"bootstrap run": silence(boot, "its address line", r["bootstrap_ready_s"])}
        maddr = next(
            line.split()[-1] for _, _, line in boot.lines if "peer join --initial-peers /ip4/127.0.0.1/" in line
        )
        print("bootstrap monitor")
        mon = Watched("monitor", [str(bin_dir / "bootstrap"), "monitor", "--initial-peers", maddr, "--port", "0"], env)
        procs.append(mon)
        r["monitor_ready_s"] = mon.wait_for(r"swarm monitor: http")
        r["monitor_first_line_s"] = mon.first_line_s()
        mon.stop()
        print("peer status (piped; the swarm has no peer yet: it looks for --wait 5 s)")
        st = Watched("status", [str(bin_dir / "peer"), "status", "--initial-peers", maddr], env)
        commands["peer status"] = silence(st, "its exit", st.wait_exit(120), to_end=True)
        print("peer doctor --initial-peers (piped)")
        doc = Watched("doctor", [str(bin_dir / "peer"), "doctor", "--initial-peers", maddr, "--device", "cpu"], env)
        commands["peer doctor"] = silence(doc, "its exit", doc.wait_exit(600), to_end=True)
        commands["peer doctor"]["report"] = [line for _, src, line in doc.lines if src == "out"]
        join_argv = [
            str(bin_dir / "peer"),
            "join",
            "--initial-peers",
            maddr,
            "--host",
            "127.0.0.1",
            "--data-dir",
            str(tmp / "peer"),
        ]
        print("peer join")
        peer = Watched("peer-a", join_argv, env)
        procs.append(peer)
        r.update(startup_figures("join", peer))
        commands["peer join"] = silence(peer, "its first round line", r["join_first_round_s"])
        r["second_peer"] = args.second_peer
        if args.second_peer:
            print("second peer (stays up: the restarted peer rejoins a training swarm)")
            other = Watched("peer-b", [*join_argv[:-1], str(tmp / "peer-b")], env)
            procs.append(other)
            other.wait_for(r"^round \d+ \|", 600)
            n = len(peer.lines)
            while not any(re.match(ROUND, line) for _, _, line in peer.lines[n:]):
                time.sleep(0.5)  # peer-a's next round, with peer-b live (grouped or not: on a loaded machine)
        # mid-round: the last round's length (from the line before its round line) times --stop-at
        rounds = [t for t, _, line in peer.lines if re.match(ROUND, line)]
        starts = [t for t, _, line in peer.lines if re.match(FIRST_STEP, line)]
        last = rounds[-1] - (rounds[-2] if len(rounds) > 1 else starts[0])
        r["stop_at"] = args.stop_at
        time.sleep(max(0.0, rounds[-1] + args.stop_at * last - (time.monotonic() - peer.t0)))
        r["sigint_stopped_to_exit_s"] = peer.sigint_and_time_exit()
        r["sigint_to_stopped_s"] = peer.sigint_to_stopped_s
        r["sigint_exit_code"] = peer.proc.returncode
        print("peer join again (restart, same data dir)")
        again = Watched("peer-a(2)", join_argv, env)
        procs.append(again)
        r.update(startup_figures("restart", again))
        commands["peer join (restart)"] = silence(again, "its first round line", r["restart_first_round_s"])
        r["restart_first_round_line"] = next(line for t, _, line in again.lines if re.match(ROUND, line))
        r.update(where_it_trained(again))
        # every warning, error or traceback line up to its first round (the Ctrl-C after it is not counted)
        r["restart_warnings"] = [
            line for t, _, line in again.lines if WARNING.search(line) and t <= r["restart_first_round_s"]
        ]
        if args.second_peer:  # its first round in a group: the restart's first sync with the swarm
            r["restart_first_sync_s"], r["restart_first_sync_line"] = first_sync_s(again)
        if args.second_peer:  # what the peer that stayed up said meanwhile (a stale donor, say)
            since, until = again.t0 - other.t0, again.t0 - other.t0 + r["restart_first_round_s"]
            # the swarm's next sync after the restart's command: no restart syncs with it earlier
            r["restart_swarm_sync_s"] = other.round_line_after(since) - since
            first = round_number(r["restart_first_round_line"])
            r["restart_swarm_syncs_missed"] = sum(
                1 for t, _, line in other.lines if t > since and re.match(ROUND, line) and round_number(line) < first
            )
            r["restart_other_peer_warnings"] = [
                line for t, _, line in other.lines if WARNING.search(line) and since <= t <= until
            ]
        r["restart_sigint_stopped_to_exit_s"] = again.sigint_and_time_exit()
        for p in reversed(procs):
            p.stop()
        print("peer swarm (the default: 3 peers; alone on the machine's share, to its first round line)")
        swarm = Watched("swarm", [str(bin_dir / "peer"), "swarm"], env)
        procs.append(swarm)
        first = swarm.wait_for(r"^peer-\d+ \| round \d+ \|", 900)
        commands["peer swarm"] = silence(swarm, "its first round line", first)
    finally:
        for p in reversed(procs):
            p.stop()
    rows = [
        ("bootstrap run: first line", r["bootstrap_first_line_s"]),
        ("bootstrap run: address line", r["bootstrap_ready_s"]),
        ("bootstrap monitor: first line", r["monitor_first_line_s"]),
        ("bootstrap monitor: page address", r["monitor_ready_s"]),
        ("peer join: first line", r["join_first_line_s"]),
        ("peer join: start line", r["join_started_s"]),
        ("peer join: reading the data (hash, tokens)", r["join_read_data_s"]),
        ("peer join: first inner step starts", r["join_first_step_s"]),
        ("peer join: first round", r["join_first_round_s"]),
        ("peer join: longest silence", r["join_longest_silence_s"]),
        ("Ctrl-C: signal to 'stopped' (step, checkpoint)", r["sigint_to_stopped_s"]),
        ("Ctrl-C: 'stopped' to exit", r["sigint_stopped_to_exit_s"]),
        ("restart: first line", r["restart_first_line_s"]),
        ("restart: reading the data (hash, tokens)", r["restart_read_data_s"]),
        ("restart: start line", r["restart_started_s"]),
        ("restart: first inner step starts", r["restart_first_step_s"]),
        ("restart: first round", r["restart_first_round_s"]),
        *(
            [
                ("restart: the swarm's next sync", r["restart_swarm_sync_s"]),
                ("restart: its first sync with the swarm (a round in a group)", r["restart_first_sync_s"]),
                ("restart: the swarm's syncs it missed (count)", r["restart_swarm_syncs_missed"]),
            ]
            if args.second_peer
            else []
        ),
        ("restart: longest silence", r["restart_longest_silence_s"]),
        ("restart Ctrl-C: 'stopped' to exit", r["restart_sigint_stopped_to_exit_s"]),
    ]
    print("\n| what | seconds |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |")
    print(f"restart warnings: {r['restart_warnings'] or 'none'}")
    if args.second_peer:
        print(f"the other peer's warnings meanwhile: {r['restart_other_peer_warnings'] or 'none'}")
    print(f"restart's first round: {r['restart_first_round_line']}")
    print(
        f"SIGINT {r['stop_at']:.2f} of a round after a round line; the restart resumed at inner step "
        f"{r['restart_resumed_step']}, trained from step {r['restart_training_step']} ({r['restart_how']})"
    )
    print("\n| command | longest silence (s) | first line (s) | longest after it (s) | until |\n|---|---|---|---|---|")
    for name, c in r["commands"].items():
        print(
            f"| {name} | {c['longest_silence_s']:.1f} | {c['first_line_s']:.1f} | "
            f"{c['longest_silence_after_first_line_s']:.1f} | {c['until']} ({c['until_s']:.1f} s) |"
        )
    r["load_average_end"] = os.getloadavg()[0]  # other jobs on the machine: the figures' context
    r["results_note"] = (
        f"{r['device']}, shared with other work: 1-minute load average {r['load_average_start']:.1f} at the start, "
        f"{r['load_average_end']:.1f} at the end (each command's own in its row). A command's silence before its "
        "first line is Python importing the CLI (hivemind, torch), which grows with the load"
    )
    print(f"load average (1 min): {r['load_average_start']:.2f} at the start, {r['load_average_end']:.2f} at the end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
