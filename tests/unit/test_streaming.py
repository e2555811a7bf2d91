"""Streaming DiLoCo (arXiv 2501.18512; peer/train/streaming.py): fragments, schedule, merge, the
manifest fields and the peer's refusal of it with pipeline stages (the round loop's streaming:
test_round_streaming.py; on the engine in one process: test_engine_sim.py)."""

import tomllib
from pathlib import Path

import pytest
import torch

from peer.config import JoinConfig
from peer.reporting import Reporter
from peer.train.model import build_model
from peer.train.streaming import block_of, land, merge, partition, shift, sync_offset
from protocol.errors import ConfigError, ManifestError
from protocol.manifest import RunManifest, dump_toml, from_dict
from protocol.presets import tiny_run
from protocol.specs import ModelSpec


def identical(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def llama_names(layers: int) -> list[str]:
    model = build_model(
        ModelSpec(hidden_size=16, num_layers=layers, num_heads=2, num_kv_heads=2, intermediate_size=32, max_seq_len=16)
    )
    return [name for name, _ in model.named_parameters()]


@pytest.mark.parametrize("layers,fragments", [(1, 1), (4, 1), (4, 2), (4, 3), (4, 4), (5, 2)])
def test_partition_covers_every_parameter_once_strided_by_block(layers, fragments):
    names = llama_names(layers)
    parts = partition(names, fragments)
    assert len(parts) == fragments and all(parts)
    flat = sorted(i for part in parts for i in part)
    assert flat == list(range(len(names)))  # every parameter exactly once
    where = {i: p for p, part in enumerate(parts) for i in part}
    for i, name in enumerate(names):
        block = block_of(name)
        if block is not None:
            assert where[i] == block % fragments  # block ℓ → fragment ℓ mod P
        elif "embed_tokens" in name:
            assert where[i] == 0
        else:  # final norm, lm_head: the last block's fragment
            assert name in ("model.norm.weight", "lm_head.weight")
            assert where[i] == (layers - 1) % fragments


def test_partition_refuses_more_fragments_than_blocks_and_models_without_blocks():
    with pytest.raises(ValueError, match=r"fragments = 5: the model has only 4 transformer block"):
        partition(llama_names(4), 5)
    with pytest.raises(ValueError, match="fragments = 0"):
        partition(llama_names(2), 0)
    with pytest.raises(ValueError, match="names a transformer block"):
        partition(["embed.weight", "head.weight"], 1)


def test_schedule_offsets_each_fragment_once_per_round():
    H, P = 10, 4
    assert [sync_offset(p, inner_steps=H, fragments=P) for p in range(P)] == [0, 2, 5, 7]
    with pytest.raises(ValueError, match="fragment = 4"):
        sync_offset(4, inner_steps=H, fragments=P)


def test_merge_alpha_one_keeps_theta_alpha_zero_takes_phi_half_is_the_midpoint():
    g = torch.Generator().manual_seed(0)
    theta = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    phi = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    kept = [t.clone() for t in theta]
    merge(kept, phi, 1.0)
    assert identical(kept, theta)
    taken = [t.clone() for t in theta]
    merge(taken, phi, 0.0)
    assert identical(taken, phi)
    half = [t.clone() for t in theta]
    merge(half, phi, 0.5)
    for h, t, p in zip(half, theta, phi):
        torch.testing.assert_close(h, 0.5 * t + 0.5 * p)
    with pytest.raises(ValueError, match=r"alpha = 1\.5"):
        merge(half, phi, 1.5)
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        merge(half, phi[::-1], 0.5)


def test_shift_keeps_the_steps_since_the_sync_and_is_merge_when_there_were_none():
    g = torch.Generator().manual_seed(1)
    at_sync = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    steps = [0.01 * torch.randn(3, 4, generator=g), 0.01 * torch.randn(5, generator=g)]
    phi = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    now = [s + d for s, d in zip(at_sync, steps)]
    for alpha in (0.0, 0.25, 0.5):
        shifted = [t.clone() for t in now]
        shift(shifted, phi, at_sync, alpha)
        for out, s, d, p in zip(shifted, at_sync, steps, phi):  # the mix of θ at the sync, plus the steps since
            torch.testing.assert_close(out, alpha * s + (1 - alpha) * p + d)
        mixed = [t.clone() for t in now]
        merge(mixed, phi, alpha)  # the paper's rule takes (1 − α) of those steps back out
        for out, m, d in zip(shifted, mixed, steps):
            torch.testing.assert_close(out - m, (1 - alpha) * d)
        # no step since the sync (τ = 0): bit for bit the paper's rule
        same, ref = [t.clone() for t in at_sync], [t.clone() for t in at_sync]
        shift(same, phi, at_sync, alpha)
        merge(ref, phi, alpha)
        assert identical(same, ref)
    kept = [t.clone() for t in now]
    shift(kept, phi, at_sync, 1.0)
    assert identical(kept, now)
    # errors leave θ and θ at the sync as they were
    before, sync_before = [t.clone() for t in now], [t.clone() for t in at_sync]
    with pytest.raises(ValueError, match=r"alpha = -0\.5"):
        shift(now, phi, at_sync, -0.5)
    with pytest.raises(ValueError, match=r"θ at the sync of shape \(5,\)"):
        shift(now, phi, at_sync[::-1], 0.5)
    with pytest.raises(ValueError, match="needs θ as it was when the sync started"):
        land(now, phi, alpha=0.5, rule="shift", at_sync=None)
    with pytest.raises(ValueError, match=r"fragment_merge = 'avg'"):
        land(now, phi, alpha=0.5, rule="avg", at_sync=at_sync)
    assert identical(now, before) and identical(at_sync, sync_before)
    land(now, phi, alpha=0.5, rule="mix", at_sync=None)
    merge(before, phi, 0.5)
    assert identical(now, before)


def test_a_blocking_landing_keeps_thetas_progress_on_the_kept_rows_only():
    """``kept_rows``: rows the group applied no mean of this peer's Δ to. There θ ← θ + (φ − φ_before)
    (its progress kept over the outer step's change); everywhere else θ ← φ, as without them."""
    g = torch.Generator().manual_seed(2)
    phi_before = [torch.randn(6, 4, generator=g), torch.randn(5, generator=g), torch.randn((), generator=g)]
    theta = [p + 0.1 * torch.randn(p.shape, generator=g) for p in phi_before]
    phi = [p + 0.01 * torch.randn(p.shape, generator=g) for p in phi_before]
    landed = [t.clone() for t in theta]
    land(landed, phi, alpha=0.0, rule="mix", at_sync=None, kept_rows=[(0, 2, 4), (2, 0, 1)], phi_before=phi_before)
    want = [p.clone() for p in phi]
    want[0][2:4] = theta[0][2:4] + (phi[0][2:4] - phi_before[0][2:4])
    want[2] = theta[2] + (phi[2] - phi_before[2])
    for got, w in zip(landed, want, strict=True):
        torch.testing.assert_close(got, w)
    assert torch.equal(landed[1], phi[1]) and torch.equal(landed[0][:2], phi[0][:2])
    # the next Δ = φ − θ there is this round's Δ again: the progress the group did not apply
    torch.testing.assert_close(phi[0][2:4] - landed[0][2:4], phi_before[0][2:4] - theta[0][2:4])
    unchanged = [t.clone() for t in theta]
    with pytest.raises(ValueError, match="kept rows need φ as it was before the outer step"):
        land(theta, phi, alpha=0.0, rule="mix", at_sync=None, kept_rows=[(0, 0, 1)])
    assert identical(theta, unchanged)


def test_fragment_merge_field_validated_and_absent_at_its_default():
    m = RunManifest().replace(sync={"overlap": "streaming", "fragment_merge": "shift"})
    assert from_dict(tomllib.loads(dump_toml(m))) == m and m.sync.fragment_merge == "shift"
    assert "fragment_merge" not in dump_toml(RunManifest().replace(sync={"overlap": "streaming"}))
    assert RunManifest().replace(sync={"fragment_merge": "mix"}).run_id == RunManifest().run_id
    assert m.run_id != RunManifest().replace(sync={"overlap": "streaming"}).run_id
    with pytest.raises(ManifestError, match=r"sync\.fragment_merge = 'avg'.*'mix', 'shift'"):
        from_dict({"sync": {"overlap": "streaming", "fragment_merge": "avg"}})


def test_manifest_fields_validated_round_tripped_and_absent_at_defaults():
    m = RunManifest().replace(
        sync={"overlap": "streaming", "fragments": 2, "fragment_delay_steps": 1, "fragment_alpha": 1.0}
    )
    assert from_dict(tomllib.loads(dump_toml(m))) == m
    assert (m.sync.fragments, m.sync.fragment_delay_steps, m.sync.fragment_alpha) == (2, 1, 1.0)
    # at their defaults the fields stay out of the encoding: run ids from before them are unchanged
    assert "fragments" not in dump_toml(RunManifest())
    assert RunManifest().replace(sync={"fragments": 4}).run_id == RunManifest().run_id
    assert RunManifest().replace(sync={"fragments": 3}).run_id != RunManifest().run_id
    with pytest.raises(ManifestError, match=r"sync\.fragment_alpha = 1\.5"):
        from_dict({"sync": {"fragment_alpha": 1.5}})
    with pytest.raises(ManifestError, match=r"sync\.fragments = 0"):
        from_dict({"sync": {"fragments": 0}})
    with pytest.raises(ManifestError, match=r"sync\.fragment_delay_steps = -1"):
        from_dict({"sync": {"fragment_delay_steps": -1}})
    # streaming only: τ < H / P and P <= model.num_layers (default model: 4 layers, H = 20)
    with pytest.raises(ManifestError, match=r"sync\.fragment_delay_steps = 5 .*20 / 4"):
        from_dict({"sync": {"overlap": "streaming", "fragment_delay_steps": 5}})
    with pytest.raises(ManifestError, match=r"sync\.fragments = 5 .*model\.num_layers = 4"):
        from_dict({"sync": {"overlap": "streaming", "fragments": 5}})
    assert from_dict({"sync": {"fragments": 5, "fragment_delay_steps": 9}}).sync.overlap == "none"


def streaming(fragments: int, delay: int, alpha: float, layers: int = 2, **sync):
    return tiny_run().replace(
        model={"num_layers": layers},
        sync={
            "overlap": "streaming",
            "fragments": fragments,
            "fragment_delay_steps": delay,
            "fragment_alpha": alpha,
            **sync,
        },
    )


def test_peer_join_refuses_overlap_with_pipeline_stages_before_any_network_work(monkeypatch, tmp_path: Path):
    import peer.node as node

    def no_network(*args, **kwargs):
        raise AssertionError("the DHT was started for a run the peer cannot train")

    monkeypatch.setattr(node, "start_dht_remembering", no_network)
    monkeypatch.setattr(node, "load_data", no_network)
    cfg = JoinConfig(new_run=streaming(2, 1, 0.5).replace(pipeline={"stages": 2}), data_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"pipeline\.stages = 2 with sync\.overlap = 'streaming'.*'none'") as error:
        node.join(cfg, Reporter("json"))
    assert error.value.exit_code == 78


def test_bench_merge_keeps_rows_not_measured_again_and_streaming_settings_apart():
    from bench.overlap import merged, quality

    def run(mode, seed, bpb, **st):
        r = {"method": "diloco", "overlap": mode, "peers": 4, "seed": seed, "final_bpb": bpb, "tokens": 10}
        return {**r, "streaming": st} if st else r

    st = {"fragments": 2, "fragment_delay_steps": 1, "fragment_alpha": 0.5}
    rows = quality(
        [run("none", 0, 2.0), run("streaming", 0, 2.2, **st), run("streaming", 0, 2.4, **{**st, "fragment_alpha": 1.0})]
    )
    assert [(r["overlap"], r.get("streaming", {}).get("fragment_alpha")) for r in rows] == [
        ("none", None),
        ("streaming", 0.5),
        ("streaming", 1.0),
    ]
    assert rows[1]["vs_none"] == pytest.approx(10.0) and rows[2]["vs_none"] == pytest.approx(20.0)
    assert [r["none_bpb"] for r in rows] == [2.0, 2.0, 2.0]
    old = quality([run("none", 0, 2.1), run("delayed", 0, 2.3)])
    out = merged(old, rows)
    assert [r["overlap"] for r in out] == ["none", "delayed", "streaming", "streaming"]
    assert out[0]["final_bpb"] == 2.0  # the fresh none row replaced the old one
    # a row recorded before sync.fragment_merge existed ran 'mix': a fresh 'mix' row replaces it, 'shift' does not
    fresh = quality(
        [
            run("none", 0, 2.0),
            run("streaming", 0, 2.1, **st, fragment_merge="mix"),
            run("streaming", 0, 2.05, **st, fragment_merge="shift"),
        ]
    )
    out = merged(rows, fresh)
    assert sorted((r["overlap"], r["final_bpb"]) for r in out) == [
        ("none", 2.0),
        ("streaming", 2.05),
        ("streaming", 2.1),
        ("streaming", 2.4),
    ]
    # a kept row says which none its vs_none is against, when a later invocation's none differs
    out = merged(rows, quality([run("none", 0, 1.9), run("delayed", 0, 2.0)]))
    assert [(r["overlap"], r["none_bpb"]) for r in out] == [
        ("none", 1.9),
        ("delayed", 1.9),
        ("streaming", 2.0),
        ("streaming", 2.0),
    ]


def test_bench_overlap_refuses_a_mode_the_config_cannot_run_before_any_simulation(tmp_path: Path):
    """bench/compare-cpu-32k.toml has 2 blocks and streaming's default is 4 fragments: the script
    stops at once naming the field and the fix, instead of after the other modes' minutes of work."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "overlap.json"
    done = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "overlap.py"),
            "--config",
            str(root / "bench" / "compare-cpu-32k.toml"),
            "--modes",
            "none",
            "streaming",
            "--peers",
            "4",
            "--seeds",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "sync.fragments = 4" in done.stderr and "--set sync.fragments=2" in done.stderr
    assert not out.exists()
