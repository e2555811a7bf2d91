"""`peer doctor --initial-peers` sizes the run the swarm announces (issue 53, item 2): the run is
chosen as `peer join` chooses it; a choice join would refuse is a problem; what does not fit says
what to change."""

from __future__ import annotations

import pytest

from peer import doctor
from peer.doctor import DoctorReport, fit_advice, render, swarm_run
from protocol.manifest import SignedManifest
from protocol.presets import PRESETS, tiny_run


def announce(monkeypatch, *manifests):
    from peer.net import dht as swarm_dht

    runs = {m.run_id: SignedManifest(m, b"") for m in manifests}
    monkeypatch.setattr(swarm_dht, "list_announced", lambda dht, **kw: runs)


def test_the_swarms_run_is_sized_not_the_default(monkeypatch):
    theirs = tiny_run().replace(name="theirs", model={"num_layers": 3})
    announce(monkeypatch, theirs)
    report = DoctorReport()
    chosen = swarm_run(report, object(), wait_s=0)
    assert chosen == theirs and not report.problems
    assert report.facts["swarm_run"] == {"run_id": theirs.run_id, "name": "theirs", "announced": True}
    assert any(line.startswith("swarm run: theirs (run id ") for line in render(report))


def test_several_runs_choose_one_as_join_does(monkeypatch):
    a, b = tiny_run().replace(name="a"), tiny_run().replace(name="b", model={"num_layers": 3})
    announce(monkeypatch, a, b)
    report = DoctorReport()
    # runs announced by others never stop a plain join (#51 item 5): nothing tells these apart, the smaller id
    assert swarm_run(report, object(), wait_s=0) == min((a, b), key=lambda m: m.run_id) and not report.problems
    report = DoctorReport()
    assert swarm_run(report, object(), run_id=b.run_id, wait_s=0) == b and not report.problems
    report = DoctorReport()
    assert swarm_run(report, object(), checkpoints={a.run_id}, wait_s=0) == a


def test_a_local_run_the_swarm_does_not_train_is_refused_as_join_does(monkeypatch):
    announce(monkeypatch, tiny_run())
    report = DoctorReport()
    assert swarm_run(report, object(), local=PRESETS["default"](), local_flag="--preset default", wait_s=0) is None
    assert "--new-run" in report.problems[0]


def test_a_remote_data_path_is_a_problem_and_a_hash_pinned_run_a_note(monkeypatch):
    with_path = tiny_run().replace(data={"source": "files", "path": "/home/someone/corpus"})
    announce(monkeypatch, with_path)
    report = DoctorReport()
    assert swarm_run(report, object(), wait_s=0) == with_path
    assert "will not take from the network" in report.problems[0]
    pinned = tiny_run().replace(data={"source": "files", "path": "", "corpus_sha256": "a" * 64})
    announce(monkeypatch, pinned)
    report = DoctorReport()
    assert swarm_run(report, object(), wait_s=0) == pinned and not report.problems
    assert any("--data PATH" in n for n in report.facts["network_notes"])


def test_no_run_announced_sizes_the_local_one(monkeypatch):
    announce(monkeypatch)
    local = tiny_run()
    report = DoctorReport()
    assert swarm_run(report, object(), local=local, local_flag="--preset tiny", wait_s=0) == local
    assert report.facts["swarm_run"]["announced"] is False
    report = DoctorReport()
    assert swarm_run(report, object(), wait_s=0) is None and "announces no run" in report.problems[0]


def test_what_does_not_fit_says_what_to_change():
    advice = fit_advice(tiny_run(), "cuda", False)
    assert "--activation-checkpointing" in advice and "--micro-batch 1" in advice and "--max-memory" in advice
    assert "--activation-checkpointing" not in fit_advice(tiny_run(), "cpu", True)


@pytest.mark.timeout(300)
def test_diagnose_of_the_swarms_run_names_it():
    run = tiny_run().replace(name="swarm-run")
    report = doctor.diagnose(run, device="cpu", steps=1)
    assert report.facts["run"] == "swarm-run" and report.can_contribute
