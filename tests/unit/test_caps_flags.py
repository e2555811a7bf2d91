"""`peer join --max-upload-mbit / --max-gb-per-day`: a bad value is one usage line naming the flag
and the value (exit 2, protocol/errors.py's usage code), and JoinConfig refuses what the CLI would."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from peer.cli import main as peer_main
from peer.config import JoinConfig


@pytest.mark.parametrize("flag", ["--max-upload-mbit", "--max-gb-per-day"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "five"])
def test_bad_cap_is_one_usage_line(flag, value):
    result = CliRunner().invoke(peer_main, ["join", flag, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output and value in result.output
    assert "Traceback" not in result.output


def test_help_names_the_caps_and_the_id_form_hivemind_prints():
    out = CliRunner().invoke(peer_main, ["join", "--help"]).output
    assert "--max-upload-mbit" in out and "--max-gb-per-day" in out
    assert "12D3KooW" not in out and "/p2p/Qm..." in out


@pytest.mark.parametrize("field", ["max_upload_mbit", "max_gb_per_day"])
@pytest.mark.parametrize("value", [0.0, -2.0, float("nan"), float("inf")])
def test_join_config_refuses_a_bad_cap(field, value):
    with pytest.raises(ValueError, match=field):
        JoinConfig(data_dir=Path("/tmp/x"), **{field: value})
