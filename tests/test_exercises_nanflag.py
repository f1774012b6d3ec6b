"""Lesson 09's checker, one verdict on a non-finite loss: the reference (and MAX or SUM of the
'bad' flags) passes on 2 and 3 ranks, each classic mistake fails naming its cause and the learner's
function, a collective only one rank calls is reported at its line within seconds, and the shipped
stub is not written yet."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from labkit.exercises.checks_nanflag import check_all_finite, reference_all_finite


def test_all_finite_the_reference_passes_on_2_and_3_ranks(runs_root, no_leftovers):
    report = check_all_finite(reference_all_finite, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is reference_all_finite


def _flag(loss, op, bad=True, test=math.isfinite):
    """A flag of one float: 1 for 'bad' (or for 'ok' when bad=False), reduced with `op`."""
    finite = test(loss.item())
    flag = torch.tensor([float(not finite if bad else finite)])
    dist.all_reduce(flag, op=op)
    return flag


def max_of_bad(loss):
    """Correct, written another way: one float, MAX."""
    return _flag(loss, dist.ReduceOp.MAX).item() == 0


def sum_of_bad(loss):
    """Correct too: SUM of 'bad' flags, read as a bool."""
    return not bool(_flag(loss, dist.ReduceOp.SUM))


def local_only(loss):
    return math.isfinite(loss.item())


def min_of_bad(loss):
    return _flag(loss, dist.ReduceOp.MIN).item() == 0


def isnan_only(loss):
    return _flag(loss, dist.ReduceOp.MAX, test=lambda v: not math.isnan(v)).item() == 0


_last = {}


def late_flag(loss):
    """Keeps this step's verdict for the next call: each step is judged on the one before."""
    verdict = _flag(loss, dist.ReduceOp.MAX).item() == 0
    answer, _last["verdict"] = _last.get("verdict", True), verdict
    return answer


def inverted(loss):
    return _flag(loss, dist.ReduceOp.MAX).item() != 0


def test_all_finite_each_classic_mistake_is_named(runs_root, no_leftovers):
    for fn in (max_of_bad, sum_of_bad):
        report = check_all_finite(fn, worlds=(3,), runs_root=runs_root)
        assert report.ok, (fn.__name__, report.text())
    for fn, words in [
        (local_only, "the ranks disagree at step 3: rank 1 skipped it, rank 0 did not"),
        (min_of_bad, "One bad rank was outvoted"),
        (isnan_only, "where a loss was inf, not NaN"),
        (late_flag, "one step after the non-finite losses"),
        (inverted, "answer is inverted"),
    ]:
        _last.clear()
        report = check_all_finite(fn, worlds=(2,), runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def only_when_bad(loss):
    """A deadlock: the rank that saw the NaN all-reduces a flag; the others never join."""
    flag = torch.tensor([0.0])
    if not math.isfinite(loss.item()):
        flag += 1
        dist.all_reduce(flag)
    return flag.item() == 0


def test_all_finite_a_collective_on_one_rank_only_is_reported_at_the_learners_line(
    runs_root, no_leftovers
):
    started = time.perf_counter()
    report = check_all_finite(only_when_bad, worlds=(2,), timeout=3, runs_root=runs_root)
    text = report.text()
    assert time.perf_counter() - started < 30, text
    assert not report.ok and report.blamed == ["only_when_bad"], text
    assert (
        "rank 1 waits in all_reduce at test_exercises_nanflag.py" in text
        and "whatever its own loss" in text
    ), text


def all_finite_stub(loss):
    raise NotImplementedError("all_finite is not written yet")


def test_all_finite_the_stub_is_not_written_yet(runs_root, no_leftovers):
    report = check_all_finite(all_finite_stub, runs_root=runs_root)
    assert (
        not report.ok and not report.failures and "all_finite is not written yet" in report.text()
    )
    assert report.use(reference_all_finite) is reference_all_finite
