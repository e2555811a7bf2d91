"""Float flags refuse nan and inf at the flag (a usage error naming the value), not in a traceback."""

import click
import pytest
from click.testing import CliRunner

from bootstrap.cli import main as bootstrap_main
from peer.cli import main as peer_main
from peer.net.cli_types import FiniteFloatRange


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
def test_finite_float_range_refuses_nan_and_inf(value):
    with pytest.raises(click.BadParameter, match="not"):
        FiniteFloatRange(0).convert(value, None, None)


def test_finite_float_range_keeps_bounds_and_values():
    kind = FiniteFloatRange(0, 10, min_open=True)
    assert kind.convert("2.5", None, None) == 2.5
    with pytest.raises(click.BadParameter, match="0<x<=10"):
        kind.convert("0", None, None)


@pytest.mark.parametrize(
    "cli, argv",
    [
        (peer_main, ["join", "--checkpoint-every"]),
        (peer_main, ["join", "--uplink-mbps"]),
        (peer_main, ["join", "--max-memory"]),
        (bootstrap_main, ["run", "--monitor-poll"]),
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_commands_refuse_a_non_finite_flag_with_a_usage_error(cli, argv, value):
    result = CliRunner().invoke(cli, [*argv, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{argv[1]}'" in result.output and value in result.output
    assert "Traceback" not in result.output
