"""peer/state/memory_need.py and memory_check.py: the per-buffer arithmetic of what a peer holds, and
the refusal when it does not fit (issue #67, item 5). The free memory is passed in as values."""

from __future__ import annotations

import dataclasses

import pytest

from peer.state import memory_check
from peer.state.memory_check import MemoryShort, check_card, check_join, host_available_bytes, shortfall
from peer.state.memory_need import (
    AVERAGER,
    GIB,
    GPU,
    HOST,
    PROCESS_OVERHEAD_BYTES,
    memory_need,
)
from peer.train.model import build_model, parameter_count
from peer.train.tokenizer import byte_tokenizer
from protocol.presets import PRESETS, default_run, tiny_run


def with_(manifest, **sections):
    """``manifest`` with fields of its sections replaced: ``with_(m, sync={"overlap": "delayed"})``."""
    return dataclasses.replace(
        manifest, **{k: dataclasses.replace(getattr(manifest, k), **v) for k, v in sections.items()}
    )


def sizes(need, where: str | None = None) -> dict[str, int]:
    return {b.name: b.bytes for b in need.buffers if where is None or b.where == where}


def named(need, prefix: str) -> int:
    return sum(b.bytes for b in need.buffers if b.name.startswith(prefix))


@pytest.mark.parametrize("preset", [tiny_run, default_run])
def test_the_parameter_count_is_the_built_models(preset):
    manifest = preset()
    assert memory_need(manifest).parameters == parameter_count(build_model(manifest.model, byte_tokenizer()))


def test_a_bpe_runs_vocabulary_sizes_its_embedding():
    small, large = (with_(PRESETS["llama-125m"](), data={"vocab_size": v}) for v in (4096, 16384))
    spec = small.model
    assert memory_need(large).parameters - memory_need(small).parameters == 2 * (16384 - 4096) * spec.hidden_size


def test_a_cpu_peer_holds_everything_on_the_host_and_the_peak_adds_the_largest_moment():
    need = memory_need(default_run(), device_type="cpu")
    M = 4 * need.parameters
    assert need.gpu_bytes == 0 and sizes(need, GPU) == {}
    host = sizes(need, HOST)
    assert host["θ (the model's parameters, fp32)"] == M and host["gradients of θ (fp32)"] == M
    assert named(need, "inner optimizer state (AdamW") == 2 * M
    always = sum(b.bytes for b in need.buffers if b.when == "always")
    moments = {m: sum(b.bytes for b in need.buffers if b.when == m) for m in ("round end", "landing", "checkpoint")}
    assert need.host_bytes == always + max(moments.values()) + PROCESS_OVERHEAD_BYTES


def test_a_cuda_peer_keeps_theta_its_gradients_and_optimizer_on_the_card_and_copies_theta_for_delta():
    cpu, cuda = (memory_need(default_run(), device_type=d) for d in ("cpu", "cuda"))
    M = 4 * cuda.parameters
    on_card = sizes(cuda, GPU)
    assert on_card["θ (the model's parameters, fp32)"] == M and on_card["gradients of θ (fp32)"] == M
    assert named(cuda, "autocast's half-precision") == M // 2  # bf16 by default on CUDA
    assert named(cpu, "autocast's half-precision") == 0
    assert named(cuda, "θ's host copy for Δ") == M and named(cpu, "θ's host copy for Δ") == 0
    assert cuda.gpu_bytes > 4 * M and cuda.host_bytes < cpu.host_bytes


def test_residuals_exist_only_with_a_lossy_codec_and_error_feedback():
    m = default_run()
    M = 4 * memory_need(m).parameters
    exact = memory_need(with_(m, compression={"codec": "none"}))
    int8 = memory_need(with_(m, compression={"codec": "int8"}))
    no_feedback = memory_need(with_(m, compression={"codec": "int8", "error_feedback": False}))
    assert named(exact, "committed error-feedback") == 0 and named(exact, "staged error-feedback") == 0
    assert named(int8, "committed error-feedback") == M and named(int8, "checkpoint: the residuals") == M
    assert named(no_feedback, "committed error-feedback") == 0 and named(no_feedback, "staged") == M
    # what the averager sends of its own pieces: fp32 exact, bf16 of the decoded values when lossy
    assert named(exact, "own pieces as sent") == M and named(int8, "own pieces as sent") == M // 2
    assert int8.process_bytes(AVERAGER) > exact.process_bytes(AVERAGER)
    half = memory_need(with_(m, compression={"codec": "int8", "residual_dtype": "bf16"}))  # kept in bf16
    for name in ("committed error-feedback", "staged error-feedback", "checkpoint: the residuals"):
        assert named(half, name) == named(int8, name) // 2 > 0


def test_noloco_sends_phi_too_and_its_landing_copies_the_outer_state():
    m = default_run()
    M = 4 * memory_need(m).parameters
    noloco = memory_need(with_(m, sync={"algorithm": "noloco"}))
    assert named(noloco, "payload buffers shared") == 2 * M and named(noloco, "the group's mean") == 2 * M
    assert named(noloco, "the outer step's new φ") == 2 * M
    assert named(memory_need(m), "the outer step's new φ") == M  # DiLoCo keeps its momentum in the mean


def test_an_overlapped_sync_holds_its_flight_through_the_next_round():
    m = default_run()
    blocking, delayed = memory_need(m), memory_need(with_(m, sync={"overlap": "delayed"}))
    M = 4 * blocking.parameters
    assert named(blocking, "ψ") == 0 and named(delayed, "ψ, where the next round started") == M
    assert named(delayed, "the sync in flight") == 2 * M
    assert delayed.host_bytes - blocking.host_bytes >= 3 * M


def test_streaming_syncs_a_fragments_share():
    m = with_(default_run(), sync={"overlap": "streaming", "fragments": 4, "fragment_delay_steps": 1})
    whole, fragment = memory_need(default_run()), memory_need(m)
    assert 0 < named(fragment, "Δ = φ − θ") < named(whole, "Δ = φ − θ")
    assert named(fragment, "committed error-feedback") == named(whole, "committed error-feedback")


def test_a_smaller_micro_batch_needs_fewer_activations():
    m = PRESETS["llama-125m"]()
    whole, one = memory_need(m), memory_need(m, micro_batch_sequences=1)
    assert named(one, "activations") * m.batch_sequences == pytest.approx(named(whole, "activations"), rel=1e-6)
    checkpointed = memory_need(m, micro_batch_sequences=1, activation_checkpointing=True)
    assert named(checkpointed, "activations") < named(one, "activations")


def test_bad_device_or_precision_is_named():
    with pytest.raises(ValueError, match="'tpu'"):
        memory_need(default_run(), device_type="tpu")
    with pytest.raises(ValueError, match="'int4'"):
        memory_need(default_run(), precision="int4")


def test_the_refusal_names_both_needs_the_free_memory_and_what_to_do():
    need = memory_need(PRESETS["llama-125m"](), device_type="cuda")
    line = shortfall(need, host_free=1 * GIB, gpu_free=80 * GIB, device="cuda:0")
    assert line is not None and "\n" not in line
    assert f"{need.host_bytes / GIB:.1f} GiB of host RAM" in line
    assert f"{need.gpu_bytes / GIB:.1f} GiB of GPU memory on cuda:0" in line
    assert "1.0 GiB of RAM available" in line and "80.0 GiB free on cuda:0" in line
    assert "--preset" in line and "close other programs" in line
    short_card = shortfall(need, host_free=1000 * GIB, gpu_free=GIB // 2, device="cuda:0")
    assert short_card is not None and "--device cuda:N" in short_card
    assert shortfall(need, host_free=1000 * GIB, gpu_free=80 * GIB) is None
    assert shortfall(need, host_free=None, gpu_free=None) is None  # nothing known: nothing refused


def test_a_cpu_peers_huge_batch_is_told_to_use_a_smaller_micro_batch():
    need = memory_need(PRESETS["llama-125m"](), device_type="cpu")  # 64 × 1024 tokens at once
    line = shortfall(need, host_free=16 * GIB)
    assert line is not None and "--micro-batch" in line and "GPU" not in line


@dataclasses.dataclass
class Device:
    device: str = "cpu"
    precision: str = "auto"
    micro_batch_sequences: int | None = None
    activation_checkpointing: bool = False


def test_join_refuses_before_building_with_exit_78():
    with pytest.raises(MemoryShort) as err:
        check_join(default_run(), Device(), host_free=100 * 2**20)
    assert err.value.exit_code == 78 and "0.1 GiB of RAM available" in str(err.value)
    need = check_join(default_run(), Device(), host_free=1000 * GIB)
    assert need.device_type == "cpu"
    check_card(need, "cpu")  # a CPU peer has no card to check


def test_join_checks_the_card_once_placed():
    need = memory_need(default_run(), device_type="cuda")
    with pytest.raises(MemoryShort, match="free on cuda:0"):
        check_card(need, "cuda:0", gpu_free=1)
    check_card(need, "cuda:0", gpu_free=1000 * GIB)


def test_available_ram_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   21230092 kB\n")
    assert host_available_bytes(meminfo) == 21230092 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert host_available_bytes(meminfo) is None
    assert host_available_bytes(tmp_path / "absent") is None


def test_the_doctor_refuses_before_it_builds_the_model(monkeypatch):
    import peer.doctor as doctor

    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: 1)
    monkeypatch.setattr(doctor, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    report = doctor.diagnose(tiny_run(), device="cpu", steps=1)
    assert report.exit_code == 78 and len(report.problems) == 1
    assert report.problems[0].startswith("not enough memory for run 'tiny'")
    lines = doctor.render(report)
    assert any(line.startswith("memory: needs ") and "GiB of host RAM (0.0 GiB available)" in line for line in lines)


def test_a_blocking_round_end_holds_no_older_snapshot():
    # peer/round/streamed.py releases it before Δ (tests/unit/test_round_memory.py): counted with a
    # checkpoint (it is back after the landing), not with Δ and the mean; an overlapped sync keeps it
    m = default_run()
    older = "the previous round's φ and outer state"
    assert next(b for b in memory_need(m).buffers if b.name.startswith(older)).when == "checkpoint"
    delayed = memory_need(with_(m, sync={"overlap": "delayed"}))
    assert next(b for b in delayed.buffers if b.name.startswith(older)).when == "always"
