"""Lesson 17's numbers-first exercise: model-state bytes per GPU. The reference passes on the
70B grid and on the tiny GPT-2 two gloo ranks hold; each usual slip is named; the keywords ignored
are named on the toy; a stub is "not written yet" and use() hands back the reference."""

from __future__ import annotations

import pytest

from labkit.exercises import checks_statebytes as sb
from labkit.exercises.checks_statebytes import check_state_bytes, model_state_bytes_per_gpu
from labkit.exercises.report import Report


def test_the_reference_passes_on_the_grid_and_on_real_ranks(runs_root, no_leftovers):
    report = check_state_bytes(model_state_bytes_per_gpu, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is model_state_bytes_per_gpu
    held = report.measured["toy"]["stage 0"][0]
    assert (
        held["params"] == held["grads"]
        and held["optimizer"] - held["counters"] == 2 * held["params"]
    )


def _bytes(psi, stage, tp, n, *, pb=2, gb=2, k=12, dp=None, divide=True, shift=0):
    dp = dp or n // tp
    stage = min(max(stage + shift, 0), 3)
    psi = psi / tp if divide else psi
    return (
        pb * psi / (dp if stage >= 3 else 1)
        + gb * psi / (dp if stage >= 2 else 1)
        + k * psi / (dp if stage >= 1 else 1)
    )


SLIPS = {  # a learner's wrong function -> words its verdict must hold
    "parameters": (
        lambda p, s, t, n, **kw: p / t / (n // t if s >= 3 else 1),
        "number of parameters",
    ),
    "gigabytes": (lambda p, s, t, n, **kw: _bytes(p, s, t, n) / 1e9, "gigabytes"),
    "k8": (lambda p, s, t, n, **kw: _bytes(p, s, t, n, k=8), "master weights forgotten"),
    "k4": (lambda p, s, t, n, **kw: _bytes(p, s, t, n, k=4), "Adam's two moments forgotten"),
    "k0": (
        lambda p, s, t, n, **kw: _bytes(p, s, t, n, k=0),
        "K = 12 bytes per parameter forgotten",
    ),
    "by_n": (lambda p, s, t, n, **kw: _bytes(p, s, t, n, dp=n), "sharded over all N GPUs"),
    "tp_not_divided": (lambda p, s, t, n, **kw: _bytes(p, s, t, n, divide=False), "not divided"),
    "early": (lambda p, s, t, n, **kw: _bytes(p, s, t, n, shift=1), "one stage early"),
    "late": (lambda p, s, t, n, **kw: _bytes(p, s, t, n, shift=-1), "one stage late"),
}


@pytest.mark.parametrize("slip", sorted(SLIPS))
def test_each_usual_slip_on_the_70b_grid_is_named(slip):
    fn, words = SLIPS[slip]
    report = Report("x", implementation=fn)
    got = [fn(sb.PSI, stage, tp, sb.N_GPUS) for stage, tp in sb._grid()]
    assert not sb._formula(report, got, "state_bytes_per_gpu")
    assert report.blamed == ["state_bytes_per_gpu"] and words in report.text(), report.text()


def test_a_slip_at_one_point_names_the_point_and_what_it_is_there():
    report = Report("x")
    got = [sb._want(s, t) if s < 3 else _bytes(sb.PSI, s, t, sb.N_GPUS, k=8) for s, t in sb._grid()]
    assert not sb._formula(report, got, "mine")
    text = report.text()
    assert (
        "at stage 3, t=1" in text and "2 of 8 points wrong" in text and "master weights" in text
    ), text


def mixed_only(num_params, stage, tp, n_gpus, *, param_bytes=2, grad_bytes=2, k=12):
    """Right on the 70B grid, but the precision keywords are ignored."""
    return _bytes(num_params, stage, tp, n_gpus)


def test_the_keywords_ignored_are_named_on_the_toy_the_ranks_held(runs_root, no_leftovers):
    report = check_state_bytes(mixed_only, runs_root=runs_root)
    text = report.text()
    assert not report.ok and report.blamed == ["mixed_only"], text
    assert (
        report.status("formula") == "pass" and "param_bytes, grad_bytes and k were ignored" in text
    ), text


def not_written(num_params, stage, tp, n_gpus, *, param_bytes=2, grad_bytes=2, k=12):
    raise NotImplementedError("state_bytes_per_gpu is not written yet")


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(
    runs_root, no_leftovers, monkeypatch
):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    report = check_state_bytes(not_written, runs_root=runs_root)
    assert not report.ok and not report.failures and "not written yet" in report.text(), (
        report.text()
    )
    assert report.use(model_state_bytes_per_gpu) is model_state_bytes_per_gpu
