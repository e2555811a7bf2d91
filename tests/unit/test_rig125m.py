"""bench/rig125m.py's arithmetic: utilization against no sync, the link floor, bytes per token and a
joiner's catch-up against its floor, from round events (issue #54)."""

import os

import pytest

from bench.rig125m import (
    batch_tokens,
    catch_up_row,
    gpu_tokens_per_s,
    nosync_tokens_per_s,
    preset_label,
    process_kind,
    rig_manifest,
    swarm_figures,
)


def rounds(times, compute, sent):
    return [
        {"time": t, "compute_s": c, "sync_s": 1.0, "tokens": 1000, "group_size": 2, "bytes_sent": b}
        for t, c, b in zip(times, compute, sent)
    ]


def test_figures_of_a_swarm_leave_out_the_warmup_round():
    run = {
        "events": {
            "a": {"round": rounds([10, 14, 18], [3, 3, 3], [9e9, 1e6, 3e6])},
            "b": {"round": rounds([10, 15, 20], [3, 3, 3], [9e9, 1e6, 3e6])},
        },
        "pss_bytes": {"a": 2**30, "b": 3 * 2**30},
        "pss_by_kind_bytes": {"a": {"peer": 2**29, "helpers": 2**28}, "b": {"peer": 3 * 2**29, "p2pd": 2**20}},
    }
    f = swarm_figures(run, warmup=1, rate=8.0)  # 8 Mbit/s: 1 MB a second
    assert f["rss_by_kind_mib"] == pytest.approx({"peer": 1024, "helpers": 128, "p2pd": 0.5})  # a kind missing: 0
    assert f["tokens_per_s"] == pytest.approx(2000 / 8 + 2000 / 10)
    assert f["floor_s"] == pytest.approx(2.0)  # 2 MB a round at 1 MB/s; the warm-up round's 9 GB left out
    assert f["bytes_per_token"] == pytest.approx(8e6 / 4000)
    assert f["rss_mib"] == pytest.approx(2048)


def test_a_peer_with_too_few_rounds_adds_nothing_and_is_named():
    run = {
        "events": {
            "a": {"round": rounds([10, 14, 18], [3, 3, 3], [9e9, 1e6, 3e6])},
            "late": {"round": rounds([10, 30], [3, 3], [9e9, 1e6])},  # downloaded the state: rounds restarted
        },
        "pss_bytes": {"a": 2**30, "late": 3 * 2**30},
    }
    f = swarm_figures(run, warmup=1, rate=8.0)
    assert f["unmeasured"] == ["late"]
    assert f["tokens_per_s"] == pytest.approx(2000 / 8)  # only a's
    assert f["rss_mib"] == pytest.approx(2048)  # every peer's memory still counts
    with pytest.raises(ValueError, match="nothing to measure"):
        swarm_figures({"events": {"late": run["events"]["late"]}, "pss_bytes": {}}, warmup=1, rate=8.0)


def test_the_nosync_reference_is_tokens_over_the_steps_seconds():
    run = {"events": {"a": {"round": rounds([100], [50.0], [0])}, "b": {"round": rounds([100], [40.0], [0])}}}
    assert nosync_tokens_per_s(run) == pytest.approx(1000 / 50 + 1000 / 40)


def test_catch_up_against_the_donors_summed_uplinks():
    run = {
        "joined_at": 100.0,
        "events": {
            "joiner": {
                "adopted_state": [{"bytes": 375_000_000, "donors": {"x": 4, "y": 4, "z": 4}, "seconds": 3.0}],
                "standin_first_step": [{"time": 112.5, "inner_step": 700}],
                "round": [],
            }
        },
    }
    row = catch_up_row(run, rate=1000.0)
    assert row["donors"] == 3 and row["state_bytes"] == 375_000_000
    assert row["seconds"] == pytest.approx(12.5)
    assert row["floor_s"] == pytest.approx(1.0)  # 3 Gbit over 3 × 1 Gbit/s
    run["events"]["joiner"]["standin_first_step"] = []
    with pytest.raises(RuntimeError, match="joiner"):
        catch_up_row(run, rate=1000.0)


def test_manifests_and_step_time_of_the_125m_preset():
    m = rig_manifest("llama-125m", "delayed", "fp32", 700, 3)
    assert (m.sync.overlap, m.sync.inner_steps, m.compression.codec) == ("delayed", 700, "none")
    ref = rig_manifest("llama-125m", "nosync", "int8", 700, 3)
    assert (ref.sync.overlap, ref.sync.inner_steps) == ("none", 2100)  # one round, its sync after all steps
    assert batch_tokens(m) == 65536
    assert gpu_tokens_per_s("llama-125m") == pytest.approx(383781.8)
    with pytest.raises(ValueError, match="'nope'"):
        rig_manifest("nope", "delayed", "fp32", 10, 3)


def test_a_preset_cut_to_fewer_blocks_keeps_its_width_batch_and_vocabulary():
    full, cut = (
        rig_manifest("llama-125m", "delayed", "int8", 100, 3),
        rig_manifest("llama-125m", "delayed", "int8", 100, 3, 2),
    )
    assert (full.model.num_layers, cut.model.num_layers) == (30, 2)
    assert cut.model.hidden_size == full.model.hidden_size and cut.data == full.data
    assert batch_tokens(cut) == batch_tokens(full)
    assert preset_label("llama-125m", 2) == "llama-125m-L2" and preset_label("llama-125m", None) == "llama-125m"
    with pytest.raises(ValueError, match="layers = 0"):
        rig_manifest("llama-125m", "delayed", "int8", 100, 3, 0)


def test_the_lab_removes_the_shared_memory_of_its_killed_peers_only(tmp_path):
    import subprocess

    from lab.netlab import _remove_shared_memory

    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = os.getpid()
    for pid in (dead.pid, alive):
        (tmp_path / f"torch_{pid}_123_0").write_bytes(b"x")
    (tmp_path / "torch_999999999_1_0").write_bytes(b"x")  # not one of the lab's
    _remove_shared_memory({str(dead.pid), str(alive)}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"torch_{alive}_123_0", "torch_999999999_1_0"])


def test_the_kinds_of_a_peers_processes():
    """The peer's own process, the helpers it forked (same command line: hivemind forks), its libp2p daemon."""
    peer = b"/venv/bin/python\0lab/standin.py\0join\0--data-dir\0/tmp/p0\0"
    assert process_kind(peer, b"") == "peer"  # its parent (ip netns exec's caller) is outside the namespace
    assert process_kind(peer, b"/usr/bin/bash\0-c\0x\0") == "peer"
    assert process_kind(peer, peer) == "helpers"
    assert process_kind(b"/venv/lib/python3.11/site-packages/hivemind/hivemind_cli/p2pd\0-listen=x\0", peer) == "p2pd"
    assert process_kind(b"/usr/bin/sleep\0" + b"1\0", b"") == "other"


def test_a_swarm_whose_syncs_fail_scores_no_utilization_for_the_rounds_it_trained_alone():
    from bench.rig125m import result_row

    alone = rounds([10, 14, 18], [3, 3, 3], [9e9, 1e6, 3e6])
    for e in alone:
        e["group_size"] = 1  # every sync failed: each peer trained on its own
    run = {"events": {"a": {"round": alone}, "b": {"round": rounds([10, 15, 20], [3, 3, 3], [9e9, 1e6, 3e6])}}}
    f = swarm_figures({**run, "pss_bytes": {}}, warmup=1, rate=8.0)
    assert f["tokens_per_s"] == pytest.approx(2000 / 8 + 2000 / 10)
    assert f["averaged_tokens_per_s"] == pytest.approx(2000 / 10)  # only b's rounds averaged
    assert f["averaged_share"] == pytest.approx(0.5) and f["mean_group_size"] == pytest.approx(1.5)
    row = result_row(
        {"preset": "chaos", "peers": 2, "uplink_mbit": 8.0, "overlap": "none", "codec": "fp32", **f}
        | {"reference_tokens_per_s": 400.0}
    )
    assert row["utilization"] == pytest.approx(200 / 400) and row["mean_group_size"] == pytest.approx(1.5)


def test_the_rewrite_refigures_the_results_from_the_detail_runs(tmp_path):
    import json

    from bench.rig125m import rewrite

    per = {"tokens_per_s": 300.0, "group_sizes": [2, 2]}
    run = {
        "preset": "chaos", "peers": 2, "uplink_mbit": 8.0, "overlap": "none", "codec": "fp32",
        "per_peer": [per, per], "reference_tokens_per_s": 1000.0,
        "sync_s": 1.0, "floor_s": 0.5, "bytes_per_token": 2.0, "rss_mib": 100.0,
    }  # fmt: skip
    ident = {k: run[k] for k in ("preset", "peers", "uplink_mbit", "overlap", "codec")}
    out = tmp_path / "rig.json"
    out.write_text(json.dumps({"results": [{**ident, "utilization": 0.6}], "catch_up": [{"seconds": 5.0}]}))
    (tmp_path / "rig.detail.json").write_text(json.dumps({"invocations": [{"runs": [run]}]}))
    rewrite(out)
    record = json.loads(out.read_text())
    assert record["results"][0]["utilization"] == pytest.approx(0.6) and record["catch_up"] == [{"seconds": 5.0}]
    assert record["results"][0]["averaged_share"] == 1.0 and record["results"][0]["mean_group_size"] == 2.0
    per["group_sizes"] = [2, 1]  # a round alone, and no per-round tokens recorded: cannot be refigured
    (tmp_path / "rig.detail.json").write_text(json.dumps({"invocations": [{"runs": [run]}]}))
    with pytest.raises(ValueError, match="rerun the swarm"):
        rewrite(out)
