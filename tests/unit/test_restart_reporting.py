"""The inner steps' live line (peer/reporting.py ``Reporter.step``): drawn on a terminal in text mode
for ``peer join`` only; a pipe, a log file or JSON output keeps one line per round."""

from __future__ import annotations

import io
import json

from peer.reporting import Reporter

ROUND = {
    "round": 3,
    "train_loss": 2.5,
    "tokens_per_s": 1234.0,
    "group_size": 1,
    "sync_s": 0.0,
    "bytes_sent": 0,
    "peers": 1,
}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def steps(reporter: Reporter) -> None:
    for k in range(1, 4):
        reporter.step(round_=2, step=k, steps=20, loss=3.0 - k / 10, tokens_per_s=500.0 * k)
    reporter.emit("round", **ROUND)
    reporter.end_steps()


def test_a_terminal_draws_the_inner_steps_and_prints_the_round_line_as_ever():
    out = Terminal()
    reporter = Reporter("text", out, live_steps=True)
    steps(reporter)
    text = out.getvalue()
    assert "round 3: inner step" in text and "/20" in text and "tok/s" in text
    assert "round 3 | loss 2.500 | 1,234 tok/s" in text
    reporter.end_steps()  # idempotent


def test_a_pipe_gets_one_line_per_round_only():
    out = io.StringIO()
    reporter = Reporter("text", out, live_steps=True)
    steps(reporter)
    assert out.getvalue().splitlines() == [
        "round 3 | loss 2.500 | 1,234 tok/s | group 1 | sync 0.0 s | sent 0 B | recv 0 B | peers 1"
    ]


def test_json_output_and_reporters_without_live_steps_draw_nothing():
    for reporter, out in [(Reporter("json", o, live_steps=True), o) for o in [Terminal()]] + [
        (Reporter("text", o), o) for o in [Terminal()]
    ]:
        steps(reporter)
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and "inner step" not in lines[0]
        if reporter.fmt == "json":
            assert json.loads(lines[0])["event"] == "round"
