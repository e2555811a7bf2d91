"""bench/byzantine.py's summary on synthetic runs: the independent row's cost, the spread over
seeds, the goal column, and ``--resume`` keeping only the current commit's runs."""

from __future__ import annotations

import json
import logging

import pytest

from bench.byzantine import (
    INDEPENDENT,
    goal_met,
    headline,
    lying_receipts_rows,
    markdown,
    merged,
    resumable,
    summarize,
)

COUNTS = {"takeovers": 0, "non_finite_rounds": 0, "honest_exits": 0}


def _run(attack: str, seed: int, bpb: float, *, malicious: int = 0, algorithm: str = "diloco", **kw) -> dict:
    return {
        "attack": attack,
        "algorithm": algorithm,
        "schedule": kw.get("schedule", "none"),
        "malicious": malicious,
        "seed": seed,
        "screening": True,
        "final_bpb": bpb,
        "per_peer_bpb": [bpb],
        "adopted_forged": 0,
        "non_finite_rounds": kw.get("non_finite_rounds", 0),
        "honest_exits": 0,
        "counts": {},
        "commit": kw.get("commit", "abc"),
    }


CLEAN = {0: 3.0, 1: 3.1, 2: 2.9}
INDEP = {0: 3.15, 1: 3.162, 2: 3.016}  # +5 %, +2 %, +4 %: mean 3.667 %
ATTACKED = {0: 3.03, 1: 3.1, 2: 2.929}  # +1 %, 0 %, +1 %


def _runs() -> list[dict]:
    runs = [_run("none", s, b) for s, b in CLEAN.items()]
    runs += [_run(INDEPENDENT, s, b, algorithm="independent") for s, b in INDEP.items()]
    runs += [_run("alie", s, b, malicious=1) for s, b in ATTACKED.items()]
    return runs


def test_the_independent_row_is_its_cost_over_clean_per_seed_averaged():
    summary = summarize(_runs())
    assert summary["independent_change"]["diloco/none"] == pytest.approx((0.05 + 0.02 + 0.04) / 3)
    assert summary["clean_loss"]["diloco/none"] == pytest.approx(3.0)
    rows = {r["attack"]: r for r in summary["rows"]}
    assert rows[INDEPENDENT]["loss_change_spread"] == pytest.approx([0.02, 0.05])
    assert rows[INDEPENDENT]["seeds"] == 3
    # the clean row: 0 by definition, its spread the seeds' own spread around their mean
    assert rows["clean"]["loss_change"] == 0.0
    assert rows["clean"]["loss_change_spread"] == pytest.approx([-0.1 / 3, 0.1 / 3])
    assert headline(summary) == pytest.approx((3.0, (0.05 + 0.02 + 0.04) / 3))


def test_an_attack_row_has_its_spread_and_is_judged_against_the_independent_cost():
    summary = summarize(_runs())
    row = next(r for r in summary["rows"] if r["attack"] == "alie")
    assert set(row) == {
        "attack",
        "algorithm",
        "schedule",
        "peers",
        "malicious",
        "loss_change",
        "loss_change_spread",
        "seeds",
        "takeovers",
        "non_finite_rounds",
        "honest_exits",
    }
    assert row["loss_change"] == pytest.approx(0.02 / 3)
    assert row["loss_change_spread"] == pytest.approx([0.0, 0.01])
    detail = next(d for d in summary["detail"] if d["attack"] == "alie")
    # +0.67 % <= 1.5 % and < 3.667 % / 3
    assert detail["goal_met"] is True
    assert detail["loss_change_per_seed"] == pytest.approx([0.01, 0.0, 0.01])
    assert "| alie | diloco | none | 1 of 8 | +0.67 % |" in markdown(summary)


def test_a_row_without_its_clean_or_independent_run_is_not_judged():
    runs = [r for r in _runs() if r["attack"] != INDEPENDENT]
    summary = summarize(runs)
    assert summary["independent_change"] == {}
    assert next(d for d in summary["detail"] if d["attack"] == "alie")["goal_met"] is None
    assert summarize([_run("alie", 0, 3.0, malicious=1)])["rows"] == []  # no clean: no row


@pytest.mark.parametrize(
    "malicious,change,independent,counts,met",
    [
        (1, 0.014, 0.045, COUNTS, True),
        (1, 0.016, 0.100, COUNTS, False),  # over +1.5 %
        (1, 0.012, 0.030, COUNTS, False),  # over a third of the floor's cost
        (2, 0.029, 0.060, COUNTS, True),
        (2, 0.029, 0.050, COUNTS, False),  # over half of it
        (1, 0.0, 0.05, {**COUNTS, "non_finite_rounds": 1}, False),
        (3, 0.0, 0.05, COUNTS, None),
    ],
)
def test_goal_met(malicious, change, independent, counts, met):
    assert goal_met(malicious, change, independent, counts) is met


def test_resume_keeps_only_the_current_commits_runs():
    config = {"sync": {"inner_steps": 25}}
    runs = [_run("none", 0, 3.0, commit="abc"), _run("none", 1, 3.0, commit="old"), _run("none", 2, 3.0)]
    del runs[2]["commit"]  # a run of a file written before commits were recorded
    kept, dropped = resumable({"config": config, "runs": runs}, commit="abc", config=config)
    assert [r["seed"] for r in kept] == [0] and dropped == 2
    kept, dropped = resumable({"config": config, "runs": runs}, commit="new-dirty", config=config)
    assert kept == [] and dropped == 3
    with pytest.raises(ValueError, match="another manifest"):
        resumable({"config": {"sync": {"inner_steps": 10}}, "runs": runs}, commit="abc", config=config)


def test_the_lying_receipts_rows_name_where_they_were_measured(tmp_path):
    assert lying_receipts_rows(tmp_path / "absent.json") == []
    path = tmp_path / "lying-receipts.json"
    runs = [{"clean": [2.9], "attacked": [2.9], "change": c} for c in (-0.004, 0.001, 0.0)]
    before = {"test": "tests/security/test_lying_receipts_swarm.py", "commit": "abc", "runs": runs}
    path.write_text(json.dumps({**before, "loss_change": -0.001, "loss_change_spread": [-0.004, 0.001]}))
    (row,) = lying_receipts_rows(path)  # a file from before its rows: the 1-liar row
    assert row["measured_on"] == "real peers (tests/security/test_lying_receipts_swarm.py, commit abc)"
    assert row["seeds"] == 3 and row["loss_change"] == -0.001 and row["loss_change_spread"] == [-0.004, 0.001]
    assert (row["malicious"], row["peers"]) == (1, 4)
    two = {"liars": 2, "peers": 5, "loss_change": 0.002, "independent_change": 0.03}
    rows = [{**two, "liars": 1, "peers": 4}, two]
    path.write_text(json.dumps({**before, "rows": [{**r, "loss_change_spread": [0, 0.004], "runs": 3} for r in rows]}))
    got = lying_receipts_rows(path)
    assert [(r["malicious"], r["peers"], r["loss_change"]) for r in got] == [(1, 4, 0.002), (2, 5, 0.002)]


def test_overlapped_rows_start_overlapping_at_the_round_asked_and_the_files_say_so(tmp_path, monkeypatch):
    """``--overlap-from-round K``: a delayed row's manifest syncs blocking before round K (the blocking
    rows are left at 0, which their manifest requires), and both files' horizon name K."""
    import bench.byzantine as byz
    from bench.compare import load_config

    seen = []
    monkeypatch.setattr(byz, "_engine", lambda m, *a, **k: seen.append(m.sync) or _fake_engine())
    monkeypatch.setattr(byz.torch, "set_num_threads", lambda n: None)  # a worker's settings, not this process's
    base, bench = load_config(byz.Path(byz.__file__).with_name("compare.toml"))
    kw = dict(rounds=4, seed=0, algorithm="diloco", attack=None, malicious=0, screening=True, threads=1)
    peer_log = logging.getLogger("peer")
    level = peer_log.level
    try:  # _train quiets the "peer" logger, as a worker process may: later tests read its warnings
        byz._train(base, bench, **kw, matchmaking_s=5.0, schedule="delayed", overlap_from_round=2)
        byz._train(base, bench, **kw, matchmaking_s=5.0, schedule="none", overlap_from_round=2)
    finally:
        peer_log.setLevel(level)
    assert [(s.overlap, s.overlap_from_round) for s in seen] == [("delayed", 2), ("none", 0)]

    out = tmp_path / "b.json"
    args = dict(commit="abc", device="cpu", command="x", rounds=4, inner_steps=25, config={}, complete=True)
    byz.write_results(out, _runs(), **args, announcements=[], wall_s=0.0, overlap_from_round=2)
    detail = json.loads(out.with_name("b.detail.json").read_text())
    assert (
        json.loads(out.read_text())["horizon"]
        == detail["horizon"]
        == {
            "rounds": 4,
            "inner_steps": 25,
            "overlap_from_round": 2,
        }
    )
    byz.write_results(out, _runs(), **args, announcements=[], wall_s=0.0)
    assert json.loads(out.read_text())["horizon"] == {"rounds": 4, "inner_steps": 25}


def _fake_engine():
    from types import SimpleNamespace

    point = SimpleNamespace(loss_bpb=3.0, per_peer_bpb=[3.0], tokens=1)
    return SimpleNamespace(
        history=[point], takeovers=0, non_finite_rounds=0, honest_exits=0, screening={}, train_s=0.0, wall_s=0.0
    )


def test_merge_joins_the_blocking_and_delayed_invocations_of_one_commit():
    """A blocking run does not depend on the overlapped rows' first round K: the two invocations'
    files become one, with K; files of two commits, manifests beyond K, or a run twice are refused."""
    config = {"sync": {"inner_steps": 25}}

    def detail(schedule: str, k: int, **over) -> dict:
        return {
            "commit": "abc",
            "rounds": 20,
            "horizon": {"rounds": 20, "inner_steps": 25, **({"overlap_from_round": k} if k else {})},
            "config": {**config, **({"overlap_from_round": k} if k else {})},
            "device": "cpu",
            "command": f"python bench/byzantine.py --schedules {schedule}",
            "complete": True,
            "runs": [_run("none", 0, 2.5, schedule=schedule), _run("alie", 0, 2.55, malicious=2, schedule=schedule)],
            **over,
        }

    got = merged([detail("none", 0), detail("delayed", 10)])
    assert got["overlap_from_round"] == 10 and got["config"]["overlap_from_round"] == 10
    assert [r["schedule"] for r in got["runs"]] == ["none", "none", "delayed", "delayed"]
    assert got["command"].count(" && ") == 1 and got["device"] == "cpu" and got["commit"] == "abc"
    with pytest.raises(ValueError, match="commits"):
        merged([detail("none", 0), detail("delayed", 10, commit="def")])
    with pytest.raises(ValueError, match="different manifests"):
        merged([detail("none", 0), detail("delayed", 10, config={"sync": {"inner_steps": 10}})])
    with pytest.raises(ValueError, match="two files"):
        merged([detail("none", 0), detail("none", 0)])
    with pytest.raises(ValueError, match="one K"):
        merged([detail("delayed", 5), detail("delayed", 10)])
