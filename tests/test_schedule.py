import math

import pytest

from labkit.training.schedule import lr_at


def test_warmup_rises_linearly_to_the_peak():
    lrs = [lr_at(s, peak=1.0, steps=100, warmup_steps=4) for s in range(5)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_cosine_runs_from_peak_to_floor():
    lrs = [lr_at(s, peak=2.0, steps=11, schedule="cosine", min_lr_ratio=0.1) for s in range(11)]
    assert lrs[0] == pytest.approx(2.0) and lrs[-1] == pytest.approx(0.2)
    assert lrs[5] == pytest.approx(0.2 + 1.8 * 0.5)  # half way: the mean of peak and floor
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_linear_decay_and_constant():
    assert lr_at(10, peak=1.0, steps=11, schedule="linear") == pytest.approx(0.0)
    assert lr_at(5, peak=1.0, steps=11, schedule="linear") == pytest.approx(0.5)
    assert lr_at(7, peak=3.0, steps=11) == 3.0


def test_warmup_then_cosine_is_continuous_at_the_join():
    before = lr_at(9, peak=1.0, steps=50, warmup_steps=10, schedule="cosine")
    after = lr_at(10, peak=1.0, steps=50, warmup_steps=10, schedule="cosine")
    assert before == pytest.approx(1.0) and after == pytest.approx(1.0)
    assert math.isclose(lr_at(49, peak=1.0, steps=50, warmup_steps=10, schedule="cosine"), 0.0, abs_tol=1e-12)


def test_unknown_schedule_raises():
    with pytest.raises(ValueError, match="schedule"):
        lr_at(0, peak=1.0, steps=5, schedule="exp")
