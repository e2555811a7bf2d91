import math

import pytest

from peer.train.inner import lr_at

KW = dict(lr=1e-3, warmup_steps=10, schedule="cosine", decay_steps=110, min_lr_ratio=0.1)


def test_warmup_then_cosine_to_floor():
    assert lr_at(0, **KW) == pytest.approx(1e-4)
    assert lr_at(9, **KW) == pytest.approx(1e-3)
    assert lr_at(10, **KW) == pytest.approx(1e-3)
    assert lr_at(60, **KW) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lr_at(110, **KW) == pytest.approx(1e-4)
    assert lr_at(10_000, **KW) == pytest.approx(1e-4)


def test_a_joiner_does_not_restart_warmup():
    # A joiner adopting round 3 with H = 20 continues at cumulative step 60: mid-decay, not warm-up.
    assert lr_at(60, **KW) == pytest.approx(5.5e-4)
    assert lr_at(60, **KW) > 5 * lr_at(0, **KW)


def test_constant_schedule():
    kw = dict(KW, schedule="constant")
    assert lr_at(5, **kw) == pytest.approx(6e-4)
    assert lr_at(500, **kw) == pytest.approx(1e-3)
