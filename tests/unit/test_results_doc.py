"""bench/results_doc.py: docs/results.md from bench/results/*.json (issue #53 item 2)."""

import json
import re
from pathlib import Path

import pytest

from bench.results_doc import REGISTRY, generic, markdown_table, render
from bench.results_questions import NOT_MEASURED, QUESTIONS, load, residual_precision, section

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_registry_entry_has_a_result_file_that_parses_and_tables(name):
    entry = REGISTRY[name]
    data = json.loads((RESULTS / f"{name}.json").read_text())
    for extra in entry.extra:
        json.loads((RESULTS / extra).read_text())
    for table in entry.tables:
        rows = table.rows(data)
        assert rows, f"{name}: table {table.caption or table.columns[0]} has no rows"
        lines = markdown_table(rows, table.columns, name)
        assert len(lines) == len(rows) + 2


def test_the_script_renders_every_current_result_with_its_plots(tmp_path):
    doc = tmp_path / "docs"
    text = render(RESULTS, doc / "img", doc)
    for name, entry in REGISTRY.items():
        assert f"## {entry.title}" in text
        assert f"`bench/results/{name}.json`" in text
    # every result file is named: by its entry, as an entry's extra, or in "Other results"
    for path in RESULTS.glob("*.json"):
        assert path.name in text
    images = [line[line.index("](") + 2 : -1] for line in text.splitlines() if line.startswith("![")]
    assert images and all((doc / image).stat().st_size > 0 for image in images)


def test_a_result_without_an_entry_is_listed_not_dropped(tmp_path):
    (tmp_path / "gpu.json").write_text((RESULTS / "gpu.json").read_text())
    (tmp_path / "brand_new.json").write_text(json.dumps({"device": "a toaster", "results": [{"a": 1, "b": 2.5}]}))
    text = render(tmp_path, tmp_path / "img", tmp_path)
    assert "## The inner loop on a GPU" in text
    assert "### brand_new" in text and "a toaster" in text and "| 1 | 2.5 |" in text


def test_a_table_column_no_row_has_is_an_error_naming_file_and_key():
    with pytest.raises(KeyError, match="x.json.*'missing'"):
        markdown_table([{"a": 1}], [("a", "A"), ("missing", "M")], "x.json")


def test_a_flat_record_without_rows_gets_a_figure_table():
    lines = generic("flat", {"loss": 1.25, "peers": 8})
    assert "| loss | 1.25 |" in lines and "| peers | 8 |" in lines


PATH_IN_DOCS = re.compile(r"(?<![\w/.-])((?:peer|protocol|bootstrap|lab|bench|tests|docs|docker)/[\w./-]*\w)")
MADE_AT_RUN_TIME = {"tests/artifacts"}


def test_every_repository_path_the_readme_and_docs_name_exists():
    """README.md and docs/*.md (not the dated notes) name only files that are in the repository."""
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in set(PATH_IN_DOCS.findall(doc.read_text())):
            module = path.rsplit(".", 1)[0] + ".py"  # peer/net/cli_types.FiniteFloatRange names a class
            if path not in MADE_AT_RUN_TIME and not (ROOT / path).exists() and not (ROOT / module).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_a_results_note_is_printed_under_its_tables(tmp_path):
    (tmp_path / "overlap_p1.json").write_text((RESULTS / "overlap_p1.json").read_text())
    text = render(tmp_path, tmp_path / "img", tmp_path)
    section = text[text.index("## Streaming with one fragment") :]
    assert "Note: utilization (issue #54)" in section


def test_no_result_file_carries_the_old_utilization_ratio():
    """The old ratio (inner steps' seconds over round wall time) rose when a sync slowed the steps
    (issue #54): result rows carry ``utilization`` (swarm tokens/s over no-sync tokens/s) or null."""
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        rows = data.get("results") if isinstance(data, dict) else None
        for row in rows if isinstance(rows, list) else []:
            assert not (isinstance(row, dict) and "compute_utilization" in row), path.name


def test_docs_results_md_is_what_the_script_writes(tmp_path):
    """docs/results.md is generated, never edited by hand (issue #66 item 4): rerun
    `python bench/results_doc.py` after changing a result file, the registry or the questions."""
    text = render(RESULTS, tmp_path / "img", tmp_path)
    assert (ROOT / "docs" / "results.md").read_text() == text, "docs/results.md is stale: run bench/results_doc.py"


MEASURED_NOW = {"quality", "overlap", "codecs", "robustness", "throughput", "catch_up", "memory", "data_stream"}


def test_the_answers_come_first_one_line_per_question(tmp_path):
    text = render(RESULTS, tmp_path / "img", tmp_path)
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[0] == "## The answers now"
    table = text[text.index("## The answers now") : text.index(sections[1])]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[:2] == ["| question | current answer | goal | source |", "| --- | --- | --- | --- |"]
    assert len(rows) == 2 + len(QUESTIONS)
    data = load(RESULTS)
    for question in QUESTIONS:
        answer = question(data)
        assert f"| {answer.question} | {answer.answer} |" in table
        if question.__name__ in MEASURED_NOW:
            assert answer.answer != NOT_MEASURED, question.__name__
            assert answer.source.startswith("`bench/results/"), answer.source


def test_a_missing_result_file_is_not_measured_yet(tmp_path):
    for question in QUESTIONS:
        answer = question({})
        assert answer.answer == NOT_MEASURED, question.__name__
        assert answer.goal and "bench/results/" not in answer.source
    # one file copied: its question is answered from it, every other one is not measured yet
    (tmp_path / "codecs.json").write_text((RESULTS / "codecs.json").read_text())
    lines = section(load(tmp_path))
    codecs = next(line for line in lines if line.startswith("| codecs"))
    assert "int8" in codecs and "`bench/results/codecs.json`" in codecs
    others = [line for line in lines if line.startswith("| ") and line not in (codecs, *lines[5:7])]
    assert others and all(f"| {NOT_MEASURED} |" in line for line in others)


def test_an_answer_whose_rows_are_missing_is_not_measured_yet():
    data = {"byzantine": {"results": [{"attack": "clean", "loss_change": 0.0}]}, "rig125m": {"results": []}}
    assert all(q(data).answer == NOT_MEASURED for q in QUESTIONS)


def test_the_residual_precision_answer_states_its_goal_and_verdict():
    record = {"codec": "int8", "peers": 4, "bf16_vs_fp32_pct": 0.0512, "goal_pct": 0.2, "met": True, "commit": "a" * 40}
    answer = residual_precision({"residual-precision": record})
    assert answer.answer == "+0.0512 % against fp32 residuals (DiLoCo, int8, N = 4): met"
    assert answer.goal == "≤ +0.2 %" and answer.source == "`bench/results/residual-precision.json` at aaaaaaa"


def _byz(rows, *, rounds=10, start=None, commit="a" * 40):
    horizon = {"rounds": rounds, "inner_steps": 25, **({"overlap_from_round": start} if start else {})}
    base = {"algorithm": "diloco", "schedule": "none", "peers": 8, "seeds": 3}
    return {"commit": commit, "horizon": horizon, "results": [{**base, **r} for r in rows]}


def test_the_robustness_answer_is_the_worst_row_where_averaging_is_worth_something():
    """Every Byzantine file counts, at its own horizon: a row is judged against its own file's and
    schedule's floor, only where that floor is at least 3 %; a later file's row of the same setting
    replaces an earlier one's."""
    from bench.results_questions import robustness

    floor = {"attack": "independent", "malicious": 0, "loss_change": 0.04}
    table = _byz([floor, {"attack": "alie", "malicious": 2, "loss_change": 0.01}])  # 25 %: met
    worse = _byz([floor, {"attack": "alie", "malicious": 2, "loss_change": 0.03, "seeds": 1}], rounds=20)
    shallow = _byz([{**floor, "loss_change": 0.01}, {"attack": "ipm", "malicious": 1, "loss_change": 0.009}])
    answer = robustness({"byzantine": table, "byzantine-diloco-h20": worse, "byzantine-noloco-h20": shallow})
    assert "DiLoCo at 20 rounds, 1 seed alie 2 of 8 +3.00 % against +4.00 %" in answer.answer
    assert "missed" in answer.answer and "ipm" not in answer.answer  # under a 3 % floor: not judged
    # the same setting measured again later (the delayed file after the gate): the later row counts
    old = _byz([floor, {"attack": "ipm", "malicious": 1, "loss_change": 0.03, "schedule": "delayed"}], start=10)
    old["results"][0]["schedule"] = "delayed"
    new = _byz([floor, {"attack": "ipm", "malicious": 1, "loss_change": 0.001, "schedule": "delayed"}], start=10)
    new["results"][0]["schedule"] = "delayed"
    data = {"byzantine": table, "byzantine-delayed-h20": old, "byzantine-delayed-h20-gated": new}
    assert "alie 2 of 8 +1.00 % against +4.00 % (25.0 %: met)" in robustness(data).answer
    # 1 of 8 is held to a third of never averaging's cost, 2 of 8 to a half (issue #65 item 4)
    one = _byz([floor, {"attack": "ipm", "malicious": 1, "loss_change": 0.016}, {**table["results"][1]}])
    assert "ipm 1 of 8 +1.60 % against +4.00 % (40.0 %: missed)" in robustness({"byzantine": one}).answer
