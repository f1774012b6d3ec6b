"""Lesson 01's exercises: the field that differs, named (check_differs), and fields_that_differ, run
on 2 gloo ranks started with variables planted at random. The reference passes; each usual mistake
(one rank's keys walked, per-rank fields named, only the first difference, values for names, ranks
that disagree) fails naming it; a raise names the line; the stubs are not written yet."""
from __future__ import annotations

import os

import pytest

from labkit.exercises.checks_fingerprint import (check_differs, check_fields_that_differ,
                                                 differing_fields)


def test_the_reference_names_exactly_the_planted_fields_on_both_ranks(runs_root, no_leftovers):
    for seed in (1, 2):   # other variables, other ranks
        report = check_fields_that_differ(differing_fields, seed=seed, runs_root=runs_root)
        assert report.ok, report.text()
        assert len(report.measured["fields"]) == 3 and report.use(None) is differing_fields


def rank0_keys(prints):
    return [k for k in prints[0] if k not in ("pid", "hostname", "cpu_affinity")
            and any(p.get(k) != prints[0][k] for p in prints)]


def with_pid(prints):
    names = set().union(*prints)
    return sorted(n for n in names if len({p.get(n) for p in prints}) > 1)


def first_only(prints):
    return differing_fields(prints)[:1]


def as_values(prints):
    return {n: [p.get(n) for p in prints] for n in differing_fields(prints)}


def by_pid(prints):
    """Rank 0 (its pid is the first fingerprint's) answers, the other says nothing differs."""
    return differing_fields(prints) if prints[0]["pid"] == str(os.getpid()) else []


@pytest.mark.parametrize("fn, words", [
    (rank0_keys, "set on rank 1 only and was missed"), (with_pid, "they differ by design"),
    (first_only, "return them all"), (as_values, "a list of str"),
    (by_pid, "the ranks returned different answers")])
def test_each_usual_mistake_is_named_with_the_learners_function(fn, words, runs_root, no_leftovers):
    report = check_fields_that_differ(fn, seed=3, runs_root=runs_root)
    assert not report.ok and report.blamed == [fn.__name__], report.text()
    assert words in report.text(), report.text()


def raises(prints):
    return sorted(prints[2])


def fields_that_differ(prints):
    """The shipped stub."""
    raise NotImplementedError("fields_that_differ is not written yet")


def test_a_raise_names_the_line_and_the_stub_is_not_written_yet(runs_root, no_leftovers):
    raised = check_fields_that_differ(raises, runs_root=runs_root)
    assert raised.blamed == ["raises"] and "IndexError" in raised.text(), raised.text()
    assert "test_exercises_fingerprint.py" in raised.text(), raised.text()
    stub = check_fields_that_differ(fields_that_differ, runs_root=runs_root)
    assert stub.missing and not stub.failures and stub.use(differing_fields) is differing_fields


def test_the_field_named_is_judged_and_the_usual_wrong_answers_say_why():
    assert check_differs("env.NCCL_IB_DISABLE", ["env.NCCL_IB_DISABLE"]).ok
    for answer, words in [("NCCL_IB_DISABLE", "the field is named 'env.NCCL_IB_DISABLE'"),
                          ("pid", "by design"), ("backend", "over gloo")]:
        report = check_differs(answer, ["env.NCCL_IB_DISABLE"])
        assert not report.ok and words in report.text() and report.blamed == ["DIFFERS"]
    assert check_differs(..., ["env.NCCL_IB_DISABLE"]).missing
