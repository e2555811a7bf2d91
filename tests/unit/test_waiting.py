"""peer/progress.py ``Waiting`` (no silent wait: a line while a long step runs) and
peer/net/lifetime.py ``exit_process`` (a stopped command exits at once, its exit handlers run)."""

import io
import subprocess
import sys
import threading
import time

import pytest

from peer.progress import Waiting


def test_a_long_step_prints_still_lines_naming_it_until_it_ends():
    stream = io.StringIO()  # not a terminal: plain lines
    with Waiting("reading the run's data", stream=stream, every_s=0.01) as waiting:
        deadline = time.monotonic() + 30  # hang guard only
        while waiting.lines < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    printed = stream.getvalue().splitlines()
    assert len(printed) == waiting.lines >= 2
    assert all(line.startswith("still reading the run's data (") and line.endswith(" s)") for line in printed)
    after = stream.getvalue()
    time.sleep(0.05)  # the ticker stopped with the step: nothing more comes
    assert stream.getvalue() == after


def test_a_short_step_prints_nothing():
    stream = io.StringIO()
    with Waiting("evaluating φ", stream=stream, every_s=3600):
        pass
    assert stream.getvalue() == ""


def test_the_ticker_thread_ends_with_the_step_even_on_an_exception():
    stream = io.StringIO()
    with pytest.raises(RuntimeError), Waiting("x", stream=stream, every_s=3600):
        raise RuntimeError("boom")
    assert not any(t.name == "waiting" and t.is_alive() for t in threading.enumerate())


def test_a_bad_interval_is_refused_naming_it():
    with pytest.raises(ValueError, match="every_s = 0"):
        Waiting("x", every_s=0)


def test_exit_process_runs_exit_handlers_flushes_and_exits_with_the_code(tmp_path):
    marker = tmp_path / "atexit-ran"
    code = (
        "import atexit, sys\n"
        "from peer.net.lifetime import exit_process\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('yes'))\n"
        "print('last line', end='')\n"  # unflushed: exit_process flushes it
        "sys.stderr.write('err line')\n"
        "exit_process(130)\n"
        "print('never')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr
    assert result.stdout == "last line" and "err line" in result.stderr
    assert marker.read_text() == "yes"


def test_exit_process_inside_a_runner_raises_system_exit_instead():
    # pytest's capture replaced the streams: the process is not the command's alone
    from peer.net.lifetime import exit_process

    with pytest.raises(SystemExit) as exc:
        exit_process(3)
    assert exc.value.code == 3


def test_catching_up_says_what_it_waits_for_when_donors_are_still_in_their_sync(monkeypatch):
    import types

    import peer.round.catchup as catchup

    said: list[tuple[str, str]] = []

    class Recorded(Waiting):  # the real ticker, every step it names recorded
        def __enter__(self):
            said.append(("enter", self.what))
            return super().__enter__()

        def __exit__(self, *exc):
            said.append(("exit", self.what))
            return super().__exit__(*exc)

    monkeypatch.setattr(catchup, "Waiting", Recorded)
    in_round_7 = [types.SimpleNamespace(peer_id="a", record=types.SimpleNamespace(round=7))]
    polls = []

    def others(**_):
        polls.append(1)
        return in_round_7 if len(polls) < 3 else []  # the donor leaves round 7 at the third poll

    t = types.SimpleNamespace(
        swarm=types.SimpleNamespace(max_sync_s=300.0, others=others),
        stop_event=types.SimpleNamespace(is_set=lambda: False, wait=lambda s: None),
    )
    catchup.CatchUp.wait_until_past(t, 7, ["a"])
    what = "waiting for 1 peer(s) to finish the sync of round 7 (up to 300 s), to download the state they hold after it"
    assert said == [("enter", what), ("exit", what)] and len(polls) == 3


def test_off_a_terminal_a_peer_says_its_first_round_still_trains_until_that_rounds_line(capsys):
    """Issue #68 item 4: a first round on a busy CPU took 75 s with no line on a pipe or in a log;
    now a line every few seconds says it trains and at which inner step, until the round's line."""
    from peer.reporting import Reporter

    out = io.StringIO()  # not a terminal
    reporter = Reporter("text", out, live_steps=True)
    reporter.tick_until_first_round(every_s=0.01)
    reporter.step(round_=0, step=3, steps=20, loss=4.9, tokens_per_s=100.0)
    deadline = time.monotonic() + 30  # hang guard only
    while "inner step 3 of 20" not in capsys.readouterr().err and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.monotonic() < deadline, "no line while the first round trained"
    reporter.emit("round", round=1, train_loss=4.2, tokens_per_s=100.0, group_size=1, sync_s=0.0, bytes_sent=0, peers=1)
    capsys.readouterr()
    time.sleep(0.05)  # the round's line came: no more
    assert capsys.readouterr().err == ""
    assert out.getvalue().startswith("round 1 | loss 4.200")

    json_reporter = Reporter("json", io.StringIO())
    json_reporter.tick_until_first_round(every_s=0.01)  # JSON: the launcher says it, not the peer
    time.sleep(0.05)
    assert capsys.readouterr().err == ""
