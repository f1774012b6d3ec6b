"""Lesson 11's exercise: the straggler found from a real run's records. One run on 3 gloo ranks with
a straggler planted serves every test: the reference names it wherever the renamed records put it;
each usual mistake (the rank that waited longest, the largest step time, off by one) is named; a
raise names the learner's line; the stub is not written yet."""
from __future__ import annotations

import pytest

from labkit.exercises.checks_straggler import check_straggler, plant_straggler, slowest_compute


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return plant_straggler(world=3, seed=7, runs_root=tmp_path_factory.mktemp("runs"))


def test_the_reference_names_the_planted_straggler_wherever_it_is(planted):
    report = check_straggler(slowest_compute, planted=planted)
    assert report.ok, report.text()
    assert report.measured["answer"] == planted.rank and report.use(None) is slowest_compute


def _median(records, column):
    return records[records["step"] >= 2].groupby("rank")[column].median()


def waited_longest(records):
    return int(_median(records, "t_fwd_bwd").idxmax())


def largest_step_time(records):
    return int(_median(records, "t_step").idxmax())


def one_based(records):
    return slowest_compute(records) + 1


def test_each_usual_mistake_is_named_with_the_learners_function(planted):
    for fn, words in [(waited_longest, "it waited FOR the straggler"),
                      (largest_step_time, "step times are equal on every rank"),
                      (one_based, "off by one")]:
        report = check_straggler(fn, planted=planted)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def always_rank_1(records):
    """The lesson's straggler was rank 1: an answer copied, not read from the records."""
    return 1


def reads_a_missing_column(records):
    return int(records.groupby("rank")["t_allreduce"].median().idxmin())


def test_a_copied_answer_fails_and_a_raise_names_the_learners_line(planted):
    copied = check_straggler(always_rank_1, planted=planted)
    assert not copied.ok and copied.blamed == ["always_rank_1"], copied.text()
    assert "whatever the records held" in copied.text(), copied.text()
    raised = check_straggler(reads_a_missing_column, planted=planted)
    assert raised.blamed == ["reads_a_missing_column"] and "KeyError" in raised.text()
    assert "test_exercises_straggler.py" in raised.text(), raised.text()


def find_straggler(records):
    """The shipped stub."""
    raise NotImplementedError("find_straggler is not written yet")


def test_the_stub_is_not_written_yet_and_a_fresh_run_is_planted(runs_root, no_leftovers, capsys):
    report = check_straggler(find_straggler, world=2, runs_root=runs_root)
    assert report.missing and not report.failures, report.text()
    assert report.use(slowest_compute) is slowest_compute
    assert "not written yet" in capsys.readouterr().out
