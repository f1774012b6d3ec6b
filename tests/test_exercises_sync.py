"""Lesson 06's checker, local SGD's periodic average: the reference passes on 2 and 3 ranks, each
classic mistake fails naming its cause and the learner's function, a deadlock is reported at the
learner's line within seconds, and the shipped stub is not written yet."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.exercises.checks_sync import averaging_steps, check_average, reference_average


def test_the_averaging_steps_are_torchs_periodic_model_averager_rule(monkeypatch):
    from torch.distributed.algorithms.model_averaging import averagers, utils

    seen: list[int] = []
    monkeypatch.setattr(
        utils, "average_parameters_or_parameter_groups", lambda params, group: seen.append(step)
    )
    averager = averagers.PeriodicModelAverager(period=4, warmup_steps=0, process_group=object())
    for step in range(12):  # called once after each optimizer step, as the lesson does
        averager.average_parameters([])
    assert seen == averaging_steps(4, 12) == [0, 4, 8]


def test_average_the_reference_passes_on_2_and_3_ranks(runs_root, no_leftovers):
    report = check_average(reference_average, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is reference_average


def average_with_avg_op(model, step, period):
    """Correct, written another way: ReduceOp.AVG on the parameters themselves."""
    if step % period == 0:
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p, op=dist.ReduceOp.AVG)


def summed(model, step, period):
    if step % period == 0:
        for p in model.parameters():
            dist.all_reduce(p.data)


def every_step(model, step, period):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


def the_gradients(model, step, period):
    if step % period == 0:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def one_step_late(model, step, period):
    if (step + 1) % period == 0:
        reference_average(model, 0, period)


def on_a_copy(model, step, period):
    if step % period == 0:
        for p in model.parameters():
            dist.all_reduce(p.data.clone())  # the sum lands in a copy, thrown away
            p.data /= dist.get_world_size()


def weights_only(model, step, period):
    if step % period == 0:
        for name, p in model.named_parameters():
            if "weight" in name:
                dist.all_reduce(p.data)
                p.data /= dist.get_world_size()


def test_average_each_classic_mistake_is_named(runs_root, no_leftovers):
    assert check_average(average_with_avg_op, worlds=(3,), runs_root=runs_root).ok
    for fn, words in [
        (summed, "3.000x the mean"),
        (every_step, "the period (4) is ignored"),
        (the_gradients, "the gradients were averaged, not the parameters"),
        (one_step_late, "off by one step"),
        (weights_only, "not on ['0.bias', '2.bias']"),
        (on_a_copy, "its own parameters divided by 3: the all-reduce is missing"),
    ]:
        world = 3 if fn in (summed, on_a_copy) else 2   # 3 ranks where the factor is said
        report = check_average(fn, worlds=(world,), runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def rank_zero_decides(model, step, period):
    """A deadlock: only rank 0 all-reduces; rank 1 never joins."""
    if step % period == 0 and dist.get_rank() == 0:
        reference_average(model, step, period)


def test_average_a_deadlock_is_reported_at_the_learners_line(runs_root, no_leftovers):
    started = time.perf_counter()
    report = check_average(rank_zero_decides, worlds=(2,), timeout=3, runs_root=runs_root)
    text = report.text()
    assert time.perf_counter() - started < 30, text
    assert not report.ok and report.blamed == ["rank_zero_decides"], text
    assert (
        "rank 0 waits in all_reduce at test_exercises_sync.py" in text
        and "in rank_zero_decides" in text
    ), text
    assert "never from the rank" in text and "checks_sync.py" not in text, text


def not_written(model, step, period):
    raise NotImplementedError("average_parameters is not written yet")


def test_average_the_stub_is_not_written_yet_and_use_gives_the_reference(
    runs_root, no_leftovers, capsys
):
    report = check_average(not_written, runs_root=runs_root)
    assert not report.ok and not report.failures and "not written yet" in report.text()
    assert report.use(reference_average) is reference_average
