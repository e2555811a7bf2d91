"""bench/compare.py's ``--set`` overrides, shared by every simulation benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.compare import apply_overrides, load_config
from protocol.errors import ManifestError

CONFIG = Path(__file__).resolve().parents[2] / "bench" / "compare.toml"


@pytest.mark.parametrize("order", [1, -1])
def test_fields_valid_only_together_apply_in_either_order(order):
    base, _ = load_config(CONFIG)
    m = apply_overrides(base, ['data.tokenizer="bpe"', "data.vocab_size=2048"][::order])
    assert (m.data.tokenizer, m.data.vocab_size) == ("bpe", 2048)
    assert m.data.seq_len_tokens == base.data.seq_len_tokens  # the section's other fields are kept


def test_later_override_wins_and_none_is_the_base():
    base, _ = load_config(CONFIG)
    assert apply_overrides(base, ["outer_optimizer.lr=1.2", "outer_optimizer.lr=1.3"]).outer_optimizer.lr == 1.3
    assert apply_overrides(base, []) is base


def test_invalid_value_names_the_field():
    base, _ = load_config(CONFIG)
    with pytest.raises(ManifestError, match="data.vocab_size"):
        apply_overrides(base, ["data.vocab_size=2048"])  # 2048 ids need the bpe tokenizer


def test_sweep_setting_parses_and_refuses_an_h_that_breaks_equal_tokens():
    from bench.sweep_outer import parse_setting

    assert parse_setting("heavy-ball:1.0:0.0:10", 25, 400) == {
        "algorithm": "diloco",
        "nesterov": False,
        "lr": 1.0,
        "momentum": 0.0,
        "inner_steps": 10,
    }
    assert parse_setting("noloco:0.7:0.5", 25, 400)["pull"] == 0.7
    for bad, why in [
        ("heavy-ball:1.0:0.0:30", "must divide the 400"),
        ("heavy-ball:1.0:0.0:0", "H = 0"),
        ("adam:1:0", "want KIND"),
        ("nesterov:x:0.9", "are numbers"),
    ]:
        with pytest.raises(SystemExit, match=why):
            parse_setting(bad, 25, 400)


@pytest.mark.parametrize("path", sorted(CONFIG.parent.glob("compare*.toml")), ids=lambda p: p.name)
def test_every_compare_config_is_a_valid_manifest_with_a_whole_per_peer_batch(path):
    """Each scale's config loads (the manifest validated, [bench] stripped) and its global batch
    splits into whole sequences per peer at every N it compares."""
    base, bench = load_config(path)
    for n in bench["peers"]:
        per_peer = bench["global_batch_tokens"] // n
        assert per_peer * n == bench["global_batch_tokens"] and per_peer % base.data.seq_len_tokens == 0, (path, n)
        assert per_peer >= 1024, (path, n)  # issue #15: per-peer batches of at least 1,024 tokens


@pytest.mark.parametrize(
    "item,why",
    [
        ("compression.codec=int8", r"'int8' is not a TOML value; a string needs quotes"),
        ("fragments=2", "expected SECTION.FIELD=VALUE"),
        ("sync.fragments", "expected SECTION.FIELD=VALUE"),
        ("sync.fragments=", "expected SECTION.FIELD=VALUE"),
    ],
)
def test_a_malformed_override_names_the_item_and_the_form(item, why):
    base, _ = load_config(CONFIG)
    with pytest.raises(ValueError, match=why) as error:
        apply_overrides(base, [item])
    assert repr(item) in str(error.value)


@pytest.mark.parametrize(
    "args, why",
    [
        (["--global-batch", "1000", "--peers", "3"], "global_batch_tokens = 1000 is not divisible by 3 peers"),
        (["--global-batch", "0"], "global_batch_tokens = 0 with 4 peers: both must be positive"),
        (["--global-batch", "96", "--peers", "3"], "batch_size_tokens = 32 is invalid"),  # not whole sequences
    ],
)
def test_compare_refuses_a_global_batch_before_any_run_starts(args, why, tmp_path):
    import subprocess
    import sys

    script = CONFIG.with_name("compare.py")
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            *args,
            "--no-plot",
            "--out-dir",
            str(tmp_path),
            "--results",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert why in result.stderr and "give --global-batch" in result.stderr, result.stderr
    assert not any(tmp_path.iterdir())  # nothing written, nothing trained


# every bench script that trains on a config's corpus, with the flag that puts its results file in tmp_path
CORPUS_SCRIPTS = [
    (
        "compare.py",
        ["--rounds", "1", "--seeds", "0", "--no-plot", "--out-dir", "{tmp}/out", "--results", "{tmp}/r.json"],
    ),
    ("overlap.py", ["--rounds", "1", "--seeds", "0", "--out", "{tmp}/r.json"]),
    ("byzantine.py", ["--rounds", "1", "--seeds", "0", "--out", "{tmp}/r.json"]),
    ("pipeline.py", ["--rounds", "1", "--seeds", "0", "--out", "{tmp}/r.json"]),
    ("codec_training.py", ["--rounds", "1", "--json", "{tmp}/r.json"]),
    ("sweep_outer.py", ["--seeds", "0", "--out", "{tmp}/r.json"]),
]


@pytest.mark.parametrize("script,flags", CORPUS_SCRIPTS, ids=[s for s, _ in CORPUS_SCRIPTS])
def test_bench_script_without_its_corpus_says_so_in_one_line(tmp_path, script, flags):
    """A config whose corpus folder is not there (bench/compare-gpu*.toml before
    bench/linux_doc_corpus.py ran): every bench script exits 78 with the path named, no traceback,
    no results file."""
    import subprocess
    import sys

    missing = tmp_path / "no-corpus-here"
    config = tmp_path / "scale.toml"
    text = CONFIG.with_name("compare-gpu-proxy.toml").read_text(encoding="utf-8")
    config.write_text(text.replace('path = "bench/data/linux-doc"', f'path = "{missing.as_posix()}"'), encoding="utf-8")
    assert str(missing) in config.read_text(encoding="utf-8")
    argv = [
        sys.executable,
        str(CONFIG.with_name(script)),
        "--config",
        str(config),
        *(f.format(tmp=tmp_path) for f in flags),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 78, result.stderr
    assert f"data.path {str(missing)!r} does not exist" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "r.json").exists()
