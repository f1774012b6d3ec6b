"""Lesson 14's MFU exercise: the learner's my_mfu(model, tokens_per_s, peak_flops, ranks). The
reference passes on the three models and on a real tinylm run's records; each usual slip fails
naming it and the learner's function; a function that never returns is reported within the
timeout; the shipped stub is not written yet and use() gives the reference; a run without the
counts is said so."""

from __future__ import annotations

import time

import pytest

import labkit
from labkit.exercises import check_mfu, reference_mfu
from labkit.exercises import checks_mfu as c

from .conftest import copy_without_model_counts

PEAK = 2e10  # one rank's peak, given: the tests time nothing


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real run for the whole file: tinylm on 2 gloo ranks, 4 steps."""
    cfg = labkit.RunConfig(world_size=2, steps=4, tensorboard=False, save_final=False)
    return labkit.launch(cfg, echo=False, progress=False, runs_root=tmp_path_factory.mktemp("runs"))


def _n(m):
    return m["params_active"] - m["params_embedding"]


def _att(m):
    return 12 * m["layers"] * m["hidden"] * m["seq_len"]


def forward_only(model, tokens_per_s, peak_flops, ranks):
    return (2 * _n(model) + _att(model) / 3) * tokens_per_s / (peak_flops * ranks)


def two_n(model, tokens_per_s, peak_flops, ranks):
    return (2 * _n(model) + _att(model)) * tokens_per_s / (peak_flops * ranks)


def no_attention(model, tokens_per_s, peak_flops, ranks):
    return 6 * _n(model) * tokens_per_s / (peak_flops * ranks)


def causal_half(model, tokens_per_s, peak_flops, ranks):
    return (6 * _n(model) + _att(model) / 2) * tokens_per_s / (peak_flops * ranks)


def total_params(model, tokens_per_s, peak_flops, ranks):
    n = model["params"] - model["params_embedding"]
    return (6 * n + _att(model)) * tokens_per_s / (peak_flops * ranks)


def with_lookups(model, tokens_per_s, peak_flops, ranks):
    return (6 * model["params_active"] + _att(model)) * tokens_per_s / (peak_flops * ranks)


def every_param(model, tokens_per_s, peak_flops, ranks):
    return (6 * model["params"] + _att(model)) * tokens_per_s / (peak_flops * ranks)


def one_rank_peak(model, tokens_per_s, peak_flops, ranks):
    return (6 * _n(model) + _att(model)) * tokens_per_s / peak_flops


def flops_not_rate(model, tokens_per_s, peak_flops, ranks):
    return (6 * _n(model) + _att(model)) / (peak_flops * ranks)


def percent(model, tokens_per_s, peak_flops, ranks):
    return 100 * reference_mfu(model, tokens_per_s, peak_flops, ranks)


SLIPS = [
    (two_n, "2N instead of 6N"),
    (no_attention, "the attention term is forgotten"),
    (total_params, "total parameters where the active ones belong"),
    (one_rank_peak, "one rank's peak"),
    (flops_not_rate, "FLOPs, not FLOP/s"),
]
MORE_SLIPS = [
    (forward_only, "forward only"),
    (causal_half, "halved for the causal mask"),
    (with_lookups, "the embedding lookups are counted"),
    (every_param, "all parameters, embeddings and an MoE's idle experts"),
    (percent, "a percentage"),
]


def test_the_reference_passes_on_the_models_and_on_a_real_runs_records(
    run, runs_root, no_leftovers
):
    report = check_mfu(reference_mfu, run=run, peak_flops=PEAK, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is reference_mfu
    assert report.measured["mfu"] == pytest.approx(run.mfu(PEAK)["mfu"], rel=1e-9)
    assert "Run.mfu()'s" in report.text() and "674,304 FLOPs per token" in report.text()


@pytest.mark.parametrize("fn,words", SLIPS, ids=[fn.__name__ for fn, _ in SLIPS])
def test_each_usual_slip_is_named_with_the_learners_function(
    fn, words, run, runs_root, no_leftovers
):
    report = check_mfu(fn, run=run, peak_flops=PEAK, runs_root=runs_root)
    assert not report.ok and report.blamed == [fn.__name__], report.text()
    assert words in report.text(), report.text()


@pytest.mark.parametrize("fn,words", MORE_SLIPS, ids=[fn.__name__ for fn, _ in MORE_SLIPS])
def test_the_other_slips_are_named_from_the_values_alone(fn, words):
    """The values a slip gives on the three models (what the ranks would hand back), judged without
    a launch: the judging is the same code the ranks' answers go through."""
    report = c.Report("x")
    got = [fn(dict(model), tps, peak, ranks) for _, model, tps, peak, ranks in c.CASES]
    assert not c._formula(report, got, fn.__name__)
    assert words in report.text() and report.blamed == [fn.__name__], report.text()


def test_every_slip_gives_other_numbers_than_the_formula_on_some_model():
    """A slip equal to the formula on all three models could not be told from a right answer."""
    for why in c._slips(*c.CASES[0][1:]):
        assert any(
            not c.close(c._slips(*case[1:])[why], c._want(*case[1:]), c.REL) for case in c.CASES
        ), why


def test_the_stub_is_not_written_yet_and_the_reference_is_used(
    run, runs_root, no_leftovers, capsys
):
    def my_mfu(model, tokens_per_s, peak_flops, ranks):
        raise NotImplementedError("my_mfu is not written yet")

    report = check_mfu(my_mfu, run=run, peak_flops=PEAK, runs_root=runs_root)
    assert report.missing and not report.failures, report.text()
    assert report.use(reference_mfu) is reference_mfu
    assert "not written yet" in capsys.readouterr().out


def test_a_function_that_never_returns_is_reported_within_the_timeout(run, runs_root, no_leftovers):
    def spins(model, tokens_per_s, peak_flops, ranks):
        while True:
            pass

    started = time.monotonic()
    report = check_mfu(spins, run=run, peak_flops=PEAK, timeout=4, runs_root=runs_root)
    assert time.monotonic() - started < 30
    assert not report.ok and report.blamed == ["spins"], report.text()


def test_a_raise_names_the_learners_line(run, runs_root, no_leftovers):
    def reads_a_field_that_is_not_there(model, tokens_per_s, peak_flops, ranks):
        return 6 * model["n_params"] * tokens_per_s / (peak_flops * ranks)

    report = check_mfu(
        reads_a_field_that_is_not_there, run=run, peak_flops=PEAK, runs_root=runs_root
    )
    assert report.blamed == ["reads_a_field_that_is_not_there"], report.text()
    assert "KeyError" in report.text() and "n_params" in report.text()


def test_a_run_recorded_before_labkit_wrote_the_counts_is_said_so(run, tmp_path):
    old = copy_without_model_counts(run.path, tmp_path / "old-run")
    report = check_mfu(reference_mfu, run=labkit.load_run(old), peak_flops=PEAK)
    assert (
        not report.ok
        and "no MFU to compare with" in report.text()
        and "model_params_active" in report.text()
    )
