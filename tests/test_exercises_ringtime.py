"""Lesson 02's exercise: one all_reduce's time predicted from the fitted α and B, then measured.
The formula's number passes (the measurement is a note, never a verdict); each usual slip is named;
the stub is not written yet and the lesson goes on with the model's number. One measurement on 2
gloo ranks; the rest is arithmetic."""

from __future__ import annotations

import pytest

from labkit.exercises.checks_ringtime import NAME, check_ring_time, ring_time_ms

SIZE, ALPHA, B = 3 * 2**20, 1.5e-4, 1.2e9


def test_the_models_number_passes_and_the_measurement_is_said(runs_root, no_leftovers):
    want = ring_time_ms(SIZE, 2, ALPHA, B)
    report = check_ring_time(
        want * 1.01, size_bytes=SIZE, world=2, alpha=ALPHA, bandwidth=B, runs_root=runs_root
    )
    assert report.ok and report.use(0.0) == want * 1.01, report.text()
    assert report.measured["measured"] > 0 and report.status("measured") in ("pass", "note"), (
        report.text()
    )
    assert "this machine measured" in report.text()


@pytest.mark.parametrize(
    "world, wrong, words",
    [
        (2, 1e3 * (2 / 2 * SIZE / B), "α is forgotten"),
        (2, 1e3 * (ALPHA + SIZE / B), "α is paid once"),
        (4, 1e3 * (6 * ALPHA + SIZE / B), "the 2(n-1)/n factor is forgotten"),
        (2, 1e3 * (2 * ALPHA + 8 * SIZE / B), "bits for bytes"),
        (2, 2 * ALPHA + SIZE / B, "in seconds"),
        (2, 1e6 * (2 * ALPHA + SIZE / B), "in microseconds"),
        (2, 1e3 * (2 * ALPHA + 3e6 / B), "MB for MiB"),
    ],
)
def test_each_usual_slip_is_named_and_blames_the_answer(world, wrong, words):
    report = check_ring_time(
        wrong, size_bytes=SIZE, world=world, alpha=ALPHA, bandwidth=B, measure=False
    )
    assert not report.ok and report.blamed == [NAME], report.text()
    assert words in report.text(), report.text()


def test_a_slip_that_is_right_at_this_world_size_passes_and_another_number_is_a_ratio():
    """At n = 2 the factor 2(n-1)/n is 1: leaving it out is no mistake there."""
    assert check_ring_time(
        1e3 * (2 * ALPHA + SIZE / B),
        size_bytes=SIZE,
        world=2,
        alpha=ALPHA,
        bandwidth=B,
        measure=False,
    ).ok
    other = check_ring_time(
        123.0, size_bytes=SIZE, world=2, alpha=ALPHA, bandwidth=B, measure=False
    )
    assert "none of the usual slips" in other.text() and other.blamed == [NAME]


def test_the_stub_is_not_written_yet_and_use_gives_the_models_number(capsys):
    report = check_ring_time(..., size_bytes=SIZE, world=2, alpha=ALPHA, bandwidth=B, measure=False)
    assert report.missing and not report.failures
    assert report.use(report.measured["formula"]) == ring_time_ms(SIZE, 2, ALPHA, B)
    assert "not written yet" in capsys.readouterr().out
