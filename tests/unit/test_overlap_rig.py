"""bench/overlap_rig.py's arithmetic: compute utilization of one peer from its round events (issue 18)."""

import pytest

from bench.overlap_rig import peer_figures, rig_manifest


def rounds(times, compute, sync=1.0):
    return [
        {"time": t, "compute_s": c, "sync_s": sync, "tokens": 100, "group_size": 4, "note": ""}
        for t, c in zip(times, compute)
    ]


def test_utilization_leaves_out_the_warmup_rounds():
    # round events at t = 10 (end of the warm-up round), 14, 18, 22: 3 rounds of 3 s compute in 12 s
    f = peer_figures(rounds([10, 14, 18, 22], [9.0, 3.0, 3.0, 3.0]), warmup=1)
    assert f["rounds"] == 3 and f["wall_s"] == 12
    assert f["compute_s"] == pytest.approx(9.0) and "compute_utilization" not in f  # the old ratio is gone
    assert f["round_s"] == pytest.approx(4.0) and f["tokens_per_s"] == pytest.approx(300 / 12)


def test_too_few_rounds_is_an_error_naming_the_count():
    with pytest.raises(ValueError, match="2 round event"):
        peer_figures(rounds([1, 2], [1, 1]), warmup=1)


def test_the_manifest_carries_the_overlap_mode():
    assert rig_manifest("delayed", 40).sync.overlap == "delayed"
    assert rig_manifest("none", 40).sync.inner_steps == 40


def test_streaming_rows_carry_p_tau_and_how_long_each_fragment_sync_overlapped():
    m = rig_manifest("streaming", 40, fragments=2, fragment_delay=3)
    assert (m.sync.fragments, m.sync.fragment_delay_steps) == (2, 3)
    events = rounds([10, 14, 18], [3.0, 3.0, 3.0])
    for e, steps in zip(events, ([], [5, 7], [9])):
        e["overlap_steps"] = steps
    assert peer_figures(events, warmup=1)["overlap_steps"] == [5, 7, 9]  # the warm-up round's are left out


def test_a_streaming_row_names_its_p_when_it_is_not_the_rigs_two_and_carries_the_merge():
    from bench.overlap_rig import fragments_of, markdown

    m = rig_manifest("streaming", 40, fragments=1, fragment_delay=2, fragment_merge="shift", fragment_alpha=0.0)
    assert (m.sync.fragments, m.sync.fragment_merge, m.sync.fragment_alpha) == (1, "shift", 0.0)
    assert fragments_of({"overlap": "streaming", "streaming": {"fragments": 1}}) == 1
    assert fragments_of({"overlap": "streaming"}) == 2  # recorded before P was: the rig's 2
    assert fragments_of({"overlap": "delayed"}) is None
    row = {
        "overlap": "streaming",
        "peers": 4,
        "uplink_mbit": 100.0,
        "inner_steps": 30,
        "payload_mb": 1.97,
        "utilization": 0.99,
        "round_s": 2.0,
        "compute_s_per_round": 1.98,
        "sync_s": 1.2,
        "blocking_share": 0.6,
        "tokens_per_s": 1e4,
        "mean_group_size": 4.0,
        "median_overlap_steps": 12,
        "fragments": 1,
    }
    assert "| streaming, P = 1 (median 12 steps) |" in markdown([row])
    assert "| streaming (median 12 steps) |" in markdown([{**row, "fragments": 2}])


def test_a_wider_rig_model_has_a_larger_payload_and_the_same_blocks():
    from bench.overlap_rig import CHAOS_PAYLOAD_MB, payload_mb, rig_model

    wide = rig_manifest("delayed", 20, hidden_size=256)
    assert (wide.model.hidden_size, wide.model.intermediate_size, wide.model.num_layers) == (256, 768, 2)
    assert rig_manifest("none", 20).model.hidden_size == 128  # lab/chaos.py's model by default
    assert CHAOS_PAYLOAD_MB == pytest.approx(1.97, abs=0.01)  # 0.49 M fp32 parameters
    assert payload_mb(wide) == pytest.approx(7.35, abs=0.01)
    with pytest.raises(ValueError, match="hidden_size = 7"):
        rig_model(7)


def test_utilization_is_tokens_per_second_against_the_same_peers_without_sync():
    from bench.overlap_rig import markdown, reference_tokens_per_s, row

    def run(mode, tokens_per_s, **kw):
        per = {"tokens_per_s": tokens_per_s}
        if mode != "nosync":
            per.update(compute_s_per_round=3.0, round_s=4.0, sync_s=1.0, group_sizes=[2])
        return {
            "overlap": mode,
            "peers": 2,
            "uplink_mbit": 100.0,
            "inner_steps": 30,
            "per_peer": {"a": per, "b": per},
            **kw,
        }

    # slower steps under the sync lower the swarm's tokens/s, hence the utilization: they cannot raise it
    delayed, reference = run("delayed", 400.0), run("nosync", 500.0)
    assert reference_tokens_per_s(delayed, [reference, delayed]) == 1000.0
    assert row(delayed, 1000.0)["utilization"] == pytest.approx(0.8)
    # a reference of other peers, another H or a stand-in run is not this run's
    assert reference_tokens_per_s(delayed, [{**reference, "peers": 4}, {**reference, "inner_steps": 60}]) is None
    assert reference_tokens_per_s(delayed, [{**reference, "standin_step_s": 0.1}]) is None
    unmeasured = row(delayed)
    assert unmeasured["utilization"] is None and "| — |" in markdown([unmeasured])


def test_only_rounds_that_averaged_count_toward_utilization():
    from bench.overlap_rig import averaged_tokens_per_s, row

    # a swarm whose syncs fail fast: two of three measured rounds trained alone (group size 1)
    events = rounds([10, 14, 18, 22], [3.0] * 4)
    for e in events[1:3]:
        e["group_size"] = 1
    f = peer_figures(events, warmup=1)
    assert f["tokens_per_s"] == pytest.approx(300 / 12) and f["averaged_rounds"] == 1
    assert f["averaged_tokens_per_s"] == pytest.approx(100 / 12)
    r = row(
        {"overlap": "none", "peers": 2, "uplink_mbit": 100.0, "inner_steps": 30, "per_peer": {"a": f, "b": f}}, 50.0
    )
    assert r["utilization"] == pytest.approx(2 * (100 / 12) / 50.0)
    assert r["averaged_share"] == pytest.approx(1 / 3) and r["mean_group_size"] == pytest.approx(2.0)
    # figures from before per-round averaged tokens: exact only when every round averaged
    old = {"tokens_per_s": 25.0, "group_sizes": [4, 4]}
    assert averaged_tokens_per_s(old) == 25.0
    with pytest.raises(ValueError, match="1 of 2 measured round"):
        averaged_tokens_per_s({**old, "group_sizes": [4, 1]})
