"""Lesson 03's exercise: the linear scaling rule with warmup as a pure function lr_at. The reference
passes on the grid and on 2 gloo ranks; each usual slip fails naming it and the learner's function;
a rule that reads the rank is caught on the ranks; the shipped stub is not written yet."""

from __future__ import annotations

import math

import torch.distributed as dist

from labkit.exercises.checks_lr import check_lr_at, scaled_lr


def test_the_reference_passes_on_the_grid_and_on_2_ranks(runs_root, no_leftovers):
    report = check_lr_at(scaled_lr, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is scaled_lr and report.measured["lrs"] == [
        0.02,
        0.04,
        0.06,
        0.06,
        0.06,
    ]


def per_rank_batch(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    peak = base_lr * per_rank_batch / base_batch
    return peak * (step + 1) / warmup_steps if step < warmup_steps else peak


def no_warmup(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    return base_lr * per_rank_batch * world / base_batch


def warmup_from_zero(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    peak = base_lr * per_rank_batch * world / base_batch
    return peak * min(1.0, step / warmup_steps) if warmup_steps else peak


def warmup_too_long(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    peak = base_lr * per_rank_batch * world / base_batch
    return peak * (step + 1) / warmup_steps if step <= warmup_steps and warmup_steps else peak


def goyal(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    peak = base_lr * per_rank_batch * world / base_batch
    return base_lr + (peak - base_lr) * step / warmup_steps if step < warmup_steps else peak


def square_root(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    peak = base_lr * math.sqrt(per_rank_batch * world / base_batch)
    return peak * (step + 1) / warmup_steps if step < warmup_steps else peak


def test_each_usual_slip_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, words in [
        (per_rank_batch, "the per-rank batch was used"),
        (no_warmup, "no warmup"),
        (warmup_from_zero, "starts at 0"),
        (warmup_too_long, "one step too long"),
        (goyal, "Goyal et al.'s ramp"),
        (square_root, "the square-root rule"),
    ]:
        report = check_lr_at(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def by_rank(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    """Reads the rank where the world size belongs: rank 0 computes world 1's LR, rank 1 2's."""
    return scaled_lr(step, base_lr, base_batch, per_rank_batch, dist.get_rank() + 1, warmup_steps)


def divides_by_zero(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    peak = base_lr * per_rank_batch * world / base_batch
    return peak * min(1.0, (step + 1) / warmup_steps)


def test_a_rule_that_reads_the_rank_parts_the_replicas_and_a_raise_names_the_line(
    runs_root, no_leftovers
):
    report = check_lr_at(by_rank, runs_root=runs_root)
    assert not report.ok and report.blamed == ["by_rank"], report.text()
    assert (
        "the ranks computed different LRs" in report.text() and "never on the rank" in report.text()
    )
    raised = check_lr_at(divides_by_zero, runs_root=runs_root)
    assert raised.blamed == ["divides_by_zero"] and "ZeroDivisionError" in raised.text(), (
        raised.text()
    )
    assert "test_exercises_lr.py" in raised.text(), raised.text()


def lr_at(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
    """The shipped stub."""
    raise NotImplementedError("lr_at is not written yet")


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(runs_root, no_leftovers, capsys):
    report = check_lr_at(lr_at, runs_root=runs_root)
    assert report.missing and not report.failures, report.text()
    assert report.use(scaled_lr) is scaled_lr and "not written yet" in capsys.readouterr().out
