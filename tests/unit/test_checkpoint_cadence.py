"""How often the round loop writes its checkpoint (``peer join --checkpoint-every``)."""

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from peer.cli import main
from peer.config import AUTO_CHECKPOINT_EVERY_S, TrainerConfig, checkpoint_bytes, checkpoint_interval_s
from peer.round import checkpoint_due
from peer.round.checkpointing import Checkpointing
from peer.train.model import spec_parameter_count
from protocol.presets import PRESETS


def _checkpoint_bytes(preset: str) -> int:
    """A preset's checkpoint as the rule sizes it (its outer state: one momentum, as many as φ)."""
    m = PRESETS[preset]()
    n = spec_parameter_count(m.model, m.data.vocab_size if m.data.tokenizer == "bpe" else 259)
    return checkpoint_bytes(parameters=n, outer_state=n)


def test_every_round_by_default_for_the_default_model():
    assert TrainerConfig().checkpoint_every_s is None  # sized to the model
    for preset in ("default", "tiny"):
        assert checkpoint_interval_s(TrainerConfig().checkpoint_every_s, _checkpoint_bytes(preset)) == 0.0
    assert all(checkpoint_due(last, now, 0.0) for last, now in [(None, 0.0), (5.0, 5.0), (5.0, 5.001)])


def test_a_large_model_checkpoints_at_most_every_ten_minutes_by_default():
    assert 2.4e9 < _checkpoint_bytes("llama-125m") < 2.6e9  # 20 bytes a parameter, fp32
    for preset in ("llama-125m", "llama-350m", "llama-1b"):
        assert checkpoint_interval_s(None, _checkpoint_bytes(preset)) == AUTO_CHECKPOINT_EVERY_S == 600.0


@pytest.mark.parametrize("flag", [0.0, 30.0, 1200.0])
@pytest.mark.parametrize("preset", ["tiny", "llama-125m"])
def test_an_explicit_interval_wins_whatever_the_model(flag, preset):
    assert (
        checkpoint_interval_s(TrainerConfig(checkpoint_every_s=flag).checkpoint_every_s, _checkpoint_bytes(preset))
        == flag
    )


@pytest.mark.parametrize(
    ("parameters", "flag", "expected"),
    [(919_424, None, 0.0), (125_077_824, None, 600.0), (125_077_824, 0.0, 0.0), (919_424, 60.0, 60.0)],
)
def test_the_round_loop_resolves_the_interval_from_its_own_tensors(parameters, flag, expected):
    """Checkpointing sizes the rule from the peer's θ and outer state (a pipeline stage: its own)."""
    tensor = SimpleNamespace(numel=lambda: parameters)
    state = SimpleNamespace(params=[tensor], outer=SimpleNamespace(state_tensors=lambda: [tensor]))
    checkpoints = Checkpointing(
        state=state,
        schedule=None,
        inner=None,
        transport=None,
        vouching=None,
        config=TrainerConfig(checkpoint_every_s=flag),
        reporter=None,
    )
    assert checkpoints.every_s == expected


def test_the_flag_defaults_to_sized_to_the_model_and_0_still_means_every_round(monkeypatch, tmp_path):
    seen = []

    def run_join(cfg, reporter, stop):
        seen.append(cfg.trainer.checkpoint_every_s)
        return 0, None

    monkeypatch.setattr("peer.node.join", run_join)
    for extra in ([], ["--checkpoint-every", "0"], ["--checkpoint-every", "90"]):
        result = CliRunner().invoke(main, ["join", "--data-dir", str(tmp_path), *extra])
        assert result.exit_code == 0, result.output
    assert seen == [None, 0.0, 90.0]


def test_the_first_round_then_once_the_interval_has_passed():
    assert checkpoint_due(None, 100.0, 600.0)  # the first round's end: a restart has something
    assert not checkpoint_due(100.0, 699.9, 600.0)
    assert checkpoint_due(100.0, 700.0, 600.0)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_bad_interval_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="checkpoint_every_s = "):
        TrainerConfig(checkpoint_every_s=bad)


def test_the_flag_refuses_a_negative_interval_before_any_work():
    result = CliRunner().invoke(main, ["join", "--checkpoint-every", "-5"])
    assert result.exit_code == 2
    assert "--checkpoint-every" in result.output and "-5" in result.output
