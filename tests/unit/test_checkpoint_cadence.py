"""How often the round loop writes its checkpoint (``peer join --checkpoint-every``)."""

import pytest
from click.testing import CliRunner

from peer.cli import main
from peer.config import TrainerConfig
from peer.round import checkpoint_due


def test_every_round_by_default():
    assert TrainerConfig().checkpoint_every_s == 0.0
    assert all(checkpoint_due(last, now, 0.0) for last, now in [(None, 0.0), (5.0, 5.0), (5.0, 5.001)])


def test_the_first_round_then_once_the_interval_has_passed():
    assert checkpoint_due(None, 100.0, 600.0)          # the first round's end: a restart has something
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
