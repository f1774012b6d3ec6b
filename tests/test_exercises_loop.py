"""The checkers of lesson 00's DDP loop and lesson 04's accumulation under no_sync: labkit's
references pass on 2 gloo ranks against one process; each classic mistake fails naming its cause and
the learner's function; a deadlock is reported at the learner's line; the shipped stub is not
written yet and use() hands back the reference."""
from __future__ import annotations

import contextlib
import inspect
import time

import torch.distributed as dist

import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.exercises import blanks
from labkit.exercises.checks_loop import (accumulate_with_no_sync, check_accumulation,
                                          check_ddp_loop, ddp_train)


def _loop(ctx, model, optimizer, batches, *, wrap=True, call_wrapper=True, share="mine", zero=True,
          reduction="mean", extra=False):
    ddp_model = DDP(model) if wrap else model
    forward = ddp_model if call_wrapper else model
    for x, y in batches + (batches[:1] if extra and ctx.rank == 1 else []):
        if share == "mine":
            # strided shares: a correct split too
            x, y = x[ctx.rank::ctx.world_size], y[ctx.rank::ctx.world_size]
        elif share == "first":
            x, y = x.chunk(ctx.world_size)[0], y.chunk(ctx.world_size)[0]
        if zero:
            optimizer.zero_grad()
        F.mse_loss(forward(x), y, reduction=reduction).backward()
        optimizer.step()


def strided_shares(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches)


def not_wrapped(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches, wrap=False)


def wrapper_not_called(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches, call_wrapper=False)


def same_share(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches, share="first")


def whole_batch(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches, share="whole")


def no_zero_grad(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches, zero=False)


def summed_loss(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches, reduction="sum")


def extra_step_on_rank_1(ctx, model, optimizer, batches):
    _loop(ctx, model, optimizer, batches, extra=True)


def test_the_loop_reference_and_a_strided_split_pass(runs_root, no_leftovers):
    for fn in (ddp_train, strided_shares):
        report = check_ddp_loop(fn, runs_root=runs_root)
        assert report.ok, report.text()
        assert report.measured["allreduces_per_step"] == [1, 1, 1]
        assert report.measured["rank_gap"] == 0
        assert report.use(None) is fn


def test_each_classic_loop_mistake_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, words in [(not_wrapped, "the model is not wrapped in DDP: no all-reduce ran (after 3 "
                                    "steps rank 0's and rank 1's weights are"),
                      (wrapper_not_called, "3 of 3 steps made no all-reduce"),
                      (same_share, "every rank read the same samples (rows 0-7 of each global "
                                   "batch of 16)"),
                      (whole_batch, "every rank read the whole global batch (16 samples)"),
                      (no_zero_grad, "the gradients accumulate across optimizer steps"),
                      (summed_loss, "the step is 8.000× one process's on the whole batch: the loss "
                                    "is summed")]:
        report = check_ddp_loop(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def test_a_rank_that_trains_one_batch_more_is_reported_as_a_hang_at_its_line(runs_root,
                                                                             no_leftovers):
    start = time.monotonic()
    report = check_ddp_loop(extra_step_on_rank_1, runs_root=runs_root, timeout=3)
    text = report.text()
    assert time.monotonic() - start < 30
    assert not report.ok and "rank 1" in text and "test_exercises_loop.py" in text, text
    assert report.blamed in (["_loop"], ["extra_step_on_rank_1"]), text


def _accumulate(ddp_model, micro_batches, optimizer, *, sync="last", divide=True, step_each=False,
                zero=True):
    if zero:
        optimizer.zero_grad()
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        skip = {"last": i < k - 1, "never": False, "always": True}[sync]
        with ddp_model.no_sync() if skip else contextlib.nullcontext():
            loss = (ddp_model(x) - y).pow(2).mean()
            (loss / k if divide else loss).backward()
        if step_each:
            optimizer.step()
    if not step_each:
        optimizer.step()


def no_no_sync(ddp_model, micro_batches, optimizer):
    _accumulate(ddp_model, micro_batches, optimizer, sync="never")


def no_sync_on_every_micro_batch(ddp_model, micro_batches, optimizer):
    _accumulate(ddp_model, micro_batches, optimizer, sync="always")


def loss_not_divided(ddp_model, micro_batches, optimizer):
    _accumulate(ddp_model, micro_batches, optimizer, divide=False)


def stepped_every_micro_batch(ddp_model, micro_batches, optimizer):
    _accumulate(ddp_model, micro_batches, optimizer, step_each=True)


def grads_never_zeroed(ddp_model, micro_batches, optimizer):
    _accumulate(ddp_model, micro_batches, optimizer, zero=False)


def test_the_accumulation_reference_and_a_nullcontext_form_pass(runs_root, no_leftovers):
    for fn in (accumulate_with_no_sync, _accumulate):
        report = check_accumulation(fn, runs_root=runs_root)
        assert report.ok, report.text()
        assert report.measured["allreduced_backwards_per_step"] == [1, 1]


def test_each_classic_accumulation_mistake_is_named_with_the_learners_function(runs_root,
                                                                               no_leftovers):
    for fn, words in [(no_no_sync, "the all-reduce ran at every micro-batch: 4 backward passes "
                                   "all-reduced in 1 optimizer step, want 1"),
                      (no_sync_on_every_micro_batch, "no backward all-reduced: no_sync() covered "
                                                     "every micro-batch, the last one too"),
                      (loss_not_divided, "the step is 4.000× one process's on the whole batch: the "
                                         "loss is not divided by the number of micro-batches (4)"),
                      (stepped_every_micro_batch, "the optimizer stepped at every micro-batch: 4 "
                                                  "steps in one call, want 1"),
                      (grads_never_zeroed, "the gradients accumulate across optimizer steps")]:
        report = check_accumulation(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def no_sync_differs_by_rank(ddp_model, micro_batches, optimizer):
    """Rank 0 keeps the last micro-batch under no_sync() too: rank 1's all-reduce waits for it
    forever."""
    sync = "always" if dist.get_rank() == 0 else "last"
    _accumulate(ddp_model, micro_batches, optimizer, sync=sync)


def test_no_sync_chosen_differently_by_rank_is_reported_as_a_hang_within_30_s(runs_root,
                                                                              no_leftovers):
    start = time.monotonic()
    report = check_accumulation(no_sync_differs_by_rank, runs_root=runs_root, timeout=3)
    text = report.text()
    assert time.monotonic() - start < 30
    assert not report.ok and "rank 1" in text and "test_exercises_loop.py" in text, text
    assert "no_sync() by the micro-batch's index" in text, text


def test_the_shipped_stubs_are_not_written_yet_and_use_hands_back_the_references(runs_root,
                                                                                 no_leftovers):
    for reference, check in ((ddp_train, check_ddp_loop),
                             (accumulate_with_no_sync, check_accumulation)):
        namespace: dict = {}
        exec(blanks.blank_source(inspect.getsource(reference)), {"DDP": DDP, "F": F}, namespace)
        report = check(namespace[reference.__name__], runs_root=runs_root)
        assert not report.ok and not report.failures, report.text()
        assert "not written yet" in report.text(), report.text()
        assert report.use(reference) is reference
