"""`peer doctor`'s local checks (peer/doctor.py) on this machine's CPU."""

import pytest
import torch

from peer.doctor import diagnose, render
from protocol.presets import tiny_run


def test_a_cpu_peer_can_contribute_and_is_told_its_throughput():
    report = diagnose(tiny_run(), device="cpu", steps=1)
    assert report.can_contribute and report.problems == []
    f = report.facts
    assert f["device"] == "cpu" and f["precision"] == "fp32" and f["micro_batch"] == tiny_run().batch_sequences
    assert f["tokens_per_s"] > 0 and f["mfu"] is None and f["versions"]["torch"] == torch.__version__
    lines = render(report)
    assert any(line.startswith("throughput: ") and "tok/s" in line for line in lines)
    assert lines[-1] == "ok: this peer can contribute"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
def test_a_missing_gpu_is_a_problem_with_what_to_do():
    report = diagnose(tiny_run(), device="cuda:0", steps=1)
    assert not report.can_contribute
    assert "--device cuda:0" in report.problems[0] and "--device cpu" in report.problems[0]
    assert render(report)[-1] == "this peer cannot contribute as it is"


def test_a_given_peak_gives_mfu_on_cpu():
    report = diagnose(tiny_run(), device="cpu", peak_tflops=1.0, steps=1)
    assert 0 < report.facts["mfu"] < 1
