"""Lesson 10's checker, ReduceLROnPlateau fed the mean held-out loss: the reference (and an
all-reduce with ReduceOp.AVG) passes on 2 ranks, each classic mistake fails naming its cause, the
epoch and the LRs, a rank deciding alone is reported as a hang at the learner's line within
seconds, and the shipped stub is not written yet."""

from __future__ import annotations

import time

import torch.distributed as dist

from labkit.exercises.checks_plateau import (HELD_OUT, check_plateau, reference_lrs,
                                             reference_plateau_step)


def test_the_reference_lrs_are_one_schedulers_fed_the_mean():
    assert reference_lrs() == [0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025]
    assert len(HELD_OUT[0]) == 2


def test_plateau_the_reference_passes(runs_root, no_leftovers):
    report = check_plateau(reference_plateau_step, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is reference_plateau_step


def avg_op(scheduler, local_val_loss):
    """Correct, written another way: ReduceOp.AVG."""
    loss = local_val_loss.clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    scheduler.step(loss)


def own_loss(scheduler, local_val_loss):
    scheduler.step(local_val_loss.item())


def summed(scheduler, local_val_loss):
    loss = local_val_loss.clone()
    dist.all_reduce(loss)
    scheduler.step(loss.item())


def on_a_copy(scheduler, local_val_loss):
    dist.all_reduce(local_val_loss.clone())  # the sum lands in a copy, thrown away
    scheduler.step(local_val_loss.item() / 2)


def twice(scheduler, local_val_loss):
    for _ in range(2):
        reference_plateau_step(scheduler, local_val_loss)


def test_plateau_each_classic_mistake_is_named(runs_root, no_leftovers):
    assert check_plateau(avg_op, runs_root=runs_root).ok
    for fn, words in [(own_loss, "fed its own held-out loss (rank 0: 0.600 at epoch 0"),
                      (own_loss, "at epoch 3 the LRs are rank 0's 0.1, rank 1's 0.05, the "
                                 "reference's 0.1"),
                      (summed, "fed 2.000x the mean held-out loss at epoch 0"),
                      (summed, "at epoch 4 the LRs are rank 0's 0.1, rank 1's 0.1"),
                      (twice, "rank 0's scheduler stepped 2 times at epoch 0"),
                      (on_a_copy, "its own held-out loss divided by 2 (rank 0: 0.300 at epoch 0")]:
        report = check_plateau(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def rank_zero_decides(scheduler, local_val_loss):
    """A hang: only rank 0 all-reduces the loss."""
    loss = local_val_loss.clone()
    if dist.get_rank() == 0:
        dist.all_reduce(loss)
    scheduler.step(loss.item() / 2)


def test_plateau_an_all_reduce_on_one_rank_is_reported_at_the_learners_line(runs_root,
                                                                            no_leftovers):
    started = time.perf_counter()
    report = check_plateau(rank_zero_decides, timeout=3, runs_root=runs_root)
    text = report.text()
    assert time.perf_counter() - started < 30, text
    assert not report.ok and report.blamed == ["rank_zero_decides"], text
    assert "rank 0 waits in all_reduce at test_exercises_plateau.py" in text, text
    assert "one rank deciding alone" in text, text


def plateau_stub(scheduler, local_val_loss):
    raise NotImplementedError("plateau_step is not written yet")


def test_plateau_the_stub_is_not_written_yet(runs_root, no_leftovers):
    report = check_plateau(plateau_stub, runs_root=runs_root)
    assert not report.ok and not report.failures
    assert "plateau_step is not written yet" in report.text()
    assert report.use(reference_plateau_step) is reference_plateau_step
