"""Lesson 18's numbers-first exercise: the bubble and the microbatches in flight of GPipe and 1F1B,
judged on a grid and against torch's schedules on 2 gloo ranks; each usual slip is named."""

from __future__ import annotations

from labkit.exercises.checks_bubble import check_pipeline_costs, reference_pipeline_costs


def test_the_reference_passes_and_the_ranks_held_what_it_says(runs_root, no_leftovers):
    report = check_pipeline_costs(reference_pipeline_costs, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["in flight"] == {
        ("GPipe", 0): 4,
        ("GPipe", 1): 4,
        ("1F1B", 0): 2,
        ("1F1B", 1): 1,
    }
    assert report.use(None) is reference_pipeline_costs


def over_m(schedule, p, m, stage):
    return (p - 1) / m, reference_pipeline_costs(schedule, p, m, stage)[1]


def p_for_p_minus_1(schedule, p, m, stage):
    return p / (m + p), reference_pipeline_costs(schedule, p, m, stage)[1]


def smaller_1f1b(schedule, p, m, stage):
    bubble, held = reference_pipeline_costs(schedule, p, m, stage)
    return (bubble / 2 if schedule == "1F1B" else bubble), held


def holds_m(schedule, p, m, stage):
    return reference_pipeline_costs(schedule, p, m, stage)[0], m


def holds_p_everywhere(schedule, p, m, stage):
    return reference_pipeline_costs(schedule, p, m, stage)[0], (
        m if schedule == "GPipe" else min(m, p)
    )


def test_each_usual_slip_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, words in [
        (over_m, "(p - 1)/m divides the idle slots"),
        (p_for_p_minus_1, "p where p - 1 belongs"),
        (smaller_1f1b, "1F1B bubble is smaller than GPipe's"),
        (holds_m, "1F1B holds m microbatches here"),
        (holds_p_everywhere, "1F1B holds p on every stage"),
    ]:
        report = check_pipeline_costs(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(
    runs_root, no_leftovers, monkeypatch
):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)

    def pipeline_costs(schedule, p, m, stage):
        raise NotImplementedError("pipeline_costs is not written yet")

    report = check_pipeline_costs(pipeline_costs, runs_root=runs_root)
    assert report.missing and not report.failures, report.text()
    assert report.use(reference_pipeline_costs) is reference_pipeline_costs
