"""Which run `peer join` trains (peer/run_choice.py): flags, the swarm's runs index, checkpoints."""

import pytest

from peer.run_choice import checkpointed_runs, choose_run
from protocol.errors import ManifestNotFound, RunChoiceNeeded
from protocol.manifest import RunManifest
from protocol.presets import PRESETS

TINY = PRESETS["tiny"]()
DEFAULT = PRESETS["default"]()
A, B = "a" * 64, "b" * 64
OWNER, OTHER = "1" * 64, "2" * 64
TINY_OWNED = TINY.with_owner(OWNER)
FIRST, SECOND = RunManifest(name="first"), RunManifest(name="second")


def stats(run_id):
    return {A: (3, 12), B: (1, 4)}.get(run_id)


def test_plain_join_takes_the_one_announced_run():
    assert choose_run({A: FIRST}, local=None) == A


def test_plain_join_with_several_runs_takes_the_bootstrap_nodes_run_else_the_most_vouched():
    # issue #51 item 5: strangers' runs never make a plain join exit
    assert choose_run({A: FIRST, B: SECOND}, local=None, home=B, weight={A: 5}.get) == B
    assert choose_run({A: FIRST, B: SECOND}, local=None, weight=lambda rid: {A: 1, B: 3}[rid]) == B
    assert choose_run({A: FIRST, B: SECOND}, local=None, home="c" * 64, weight=lambda rid: {A: 2, B: 1}[rid]) == A
    assert choose_run({A: FIRST, B: SECOND}, local=None) == A  # nothing tells them apart: the smallest run id


def test_plain_join_picks_the_run_its_checkpoint_belongs_to():
    assert choose_run({A: FIRST, B: SECOND}, local=None, checkpoints={B, "c" * 64}) == B


def test_checkpoints_of_several_announced_runs_choose_the_most_vouched_of_them():
    c = "c" * 64
    announced = {A: FIRST, B: SECOND, c: FIRST}
    assert choose_run(announced, local=None, checkpoints={A, B}, weight=lambda rid: {A: 1, B: 2, c: 9}[rid]) == B


def test_run_id_wins_and_no_run_announced_is_retryable():
    assert choose_run({A: FIRST, B: SECOND}, local=None, run_id=B) == B
    with pytest.raises(ManifestNotFound):
        choose_run({}, local=None)


def test_local_run_joins_the_swarms_run_of_its_content_or_starts_when_none():
    assert choose_run({}, local=TINY) is None  # start it: this peer becomes its owner
    assert choose_run({TINY_OWNED.run_id: TINY_OWNED, A: FIRST}, local=TINY) == TINY_OWNED.run_id
    # a manifest that names its owner is that one run, not another owner's of the same content
    assert choose_run({TINY_OWNED.run_id: TINY_OWNED}, local=TINY_OWNED) == TINY_OWNED.run_id
    assert choose_run({}, local=TINY_OWNED) is None
    with pytest.raises(RunChoiceNeeded):
        choose_run({TINY_OWNED.run_id: TINY_OWNED}, local=TINY.with_owner(OTHER))


def test_local_content_announced_by_two_owners_takes_the_bootstrap_nodes_or_the_most_vouched():
    theirs = TINY.with_owner(OTHER)
    announced = {TINY_OWNED.run_id: TINY_OWNED, theirs.run_id: theirs}
    assert choose_run(announced, local=TINY, home=TINY_OWNED.run_id) == TINY_OWNED.run_id
    weights = {TINY_OWNED.run_id: 0, theirs.run_id: 2}
    assert choose_run(announced, local=TINY, local_flag="--preset tiny", weight=weights.get) == theirs.run_id
    assert choose_run(announced, local=TINY, run_id=theirs.run_id) == theirs.run_id


def test_local_run_other_than_the_swarms_is_refused_unless_new_run():
    default = DEFAULT.with_owner(OWNER)
    with pytest.raises(RunChoiceNeeded) as info:
        choose_run({default.run_id: default}, local=TINY, local_flag="--preset tiny")
    text = str(info.value)
    assert "--preset tiny" in text and "'tiny'" in text and default.run_id in text and "--new-run" in text
    assert choose_run({default.run_id: default}, local=TINY, new_run=True) is None


def test_run_id_and_local_run_must_agree():
    with pytest.raises(RunChoiceNeeded, match="different runs"):
        choose_run({}, local=TINY, run_id=A)


def test_checkpointed_runs_reads_the_data_dir(tmp_path):
    assert checkpointed_runs(tmp_path) == set()
    (tmp_path / "runs" / A).mkdir(parents=True)
    (tmp_path / "runs" / A / "checkpoint.safetensors").write_bytes(b"x")
    (tmp_path / "runs" / B).mkdir()
    assert checkpointed_runs(tmp_path) == {A}
