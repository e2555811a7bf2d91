"""The right run, always: a joiner trains the swarm's run, starts another only when told to, and a
plain join among several runs trains the one the bootstrap node it dialed announces as its own
(issue #51 item 5: runs announced by others never make it exit; real bootstrap and peers on 127.0.0.1)."""

import pytest

from protocol.errors import RunChoiceNeeded
from protocol.presets import PRESETS
from tests.integration.harness import OWNER, make_manifest, write_manifest

pytestmark = pytest.mark.integration


def stderr_error(child) -> str:
    return next((line for line in reversed(child.tail(200).splitlines()) if line.startswith("error: ")), "")


def test_other_preset_is_refused_new_run_starts_it_and_a_plain_join_takes_the_bootstrap_nodes_run(procs, tmp_path):
    swarm_run = make_manifest(name="right-run-swarm")
    tiny_preset = PRESETS["tiny"]()
    tiny = tiny_preset.with_owner(OWNER.public_hex)  # the run a peer holding OWNER's key starts from the preset
    assert swarm_run.run_id != tiny.run_id
    _, addr = procs.bootstrap(write_manifest(tmp_path, swarm_run))
    code = RunChoiceNeeded.exit_code

    # Another preset than the swarm's run: refused, naming both runs and the flag that starts it anyway.
    refused = procs.peer("refused", "--initial-peers", addr, "--preset", "tiny")
    assert refused.wait(120) == code, refused.tail()
    line = stderr_error(refused)
    assert "--preset tiny" in line and repr(tiny.name) in line and swarm_run.run_id in line and "--new-run" in line, (
        line
    )
    assert not refused.of("started")

    # With --new-run it starts the preset's run beside the swarm's.
    beside = procs.peer("beside", "--initial-peers", addr, "--preset", "tiny", "--new-run", "--max-rounds", "1")
    assert beside.wait(240) == 0, beside.tail()
    assert beside.of("started")[0]["run_id"] == tiny.run_id

    # A plain join now finds two runs: it trains the one the bootstrap node announces as its own.
    plain = procs.peer("plain", "--initial-peers", addr, "--max-rounds", "0")
    assert plain.wait(120) == 0, plain.tail()
    assert plain.of("started")[0]["run_id"] == swarm_run.run_id

    # A plain join from the data dir that holds a checkpoint of the preset's run resumes that run.
    again = procs.peer("beside", "--initial-peers", addr, "--max-rounds", "1")
    assert again.wait(120) == 0, again.tail()
    assert again.of("started")[0]["run_id"] == tiny.run_id
    assert again.of("resumed")[0]["round"] == 1

    # With --run-id the plain joiner joins the one it names.
    chosen = procs.peer("chosen", "--initial-peers", addr, "--run-id", swarm_run.run_id, "--max-rounds", "0")
    assert chosen.wait(120) == 0, chosen.tail()
    assert chosen.of("started")[0]["run_id"] == swarm_run.run_id


def test_a_run_id_the_swarm_does_not_announce_is_refused_listing_the_runs_it_does(procs, tmp_path):
    # issue #68 item 7: it waited out the manifest wait (25 s) and named no run
    swarm_run = make_manifest(name="right-run-listed")
    _, addr = procs.bootstrap(write_manifest(tmp_path, swarm_run))
    wrong = "ab" * 16
    peer = procs.peer("wrong", "--initial-peers", addr, "--run-id", wrong)
    assert peer.wait(120) == RunChoiceNeeded.exit_code, peer.tail()
    line = stderr_error(peer)
    assert f"--run-id {wrong}: the swarm announces no such run" in line, line
    assert f"{swarm_run.name!r} (run id {swarm_run.run_id})" in line, line
    assert not peer.of("started")
