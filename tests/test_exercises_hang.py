"""Lesson 12's exercise: a hang report read (the rank to fix, the collective it never made), then
the planted early stop fixed. The reading is judged against the failure read; the fix runs on 2 gloo
ranks against one process's weights, each wrong stopping rule is named by where it stopped, and a
fix that still hangs is reported at the learner's lines within 30 s."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.exercises.checks_hang import check_hang_fix, check_hang_report, train_until_fixed
from labkit.run import RankFailure
from labkit.run.failure import RankStatus


def _waiting(rank: int, op: str, line: int) -> RankStatus:
    return RankStatus(rank, "waiting", 2, -1, f"waiting inside torch (c10d.py:1 in {op}), called at"
                                              f" 2841.py:{line} in train_until, for 2.1 s")


def planted_failure(tmp_path) -> RankFailure:
    """What the planted run on 3 ranks reports: ranks 0 and 1 wait in all_reduce, rank 2 (it left
    the loop) in barrier."""
    statuses = [_waiting(0, "all_reduce", 9), _waiting(1, "all_reduce", 9),
                _waiting(2, "barrier", 11)]
    return RankFailure(statuses[2], statuses, tmp_path)


def test_a_reading_names_the_rank_out_of_place_and_the_collective_the_others_wait_in(tmp_path):
    failure = planted_failure(tmp_path)
    assert check_hang_report(2, "all_reduce", failure).ok
    assert check_hang_report("rank 2", "dist.all_reduce", failure).ok
    waiter = check_hang_report(0, "all_reduce", failure)
    assert not waiter.ok and waiter.blamed == ["HUNG_RANK"]
    assert "rank 0 waits in all_reduce, as rank 1 does: it arrived" in waiter.text(), waiter.text()
    where = check_hang_report(2, "barrier", failure)
    assert not where.ok and where.blamed == ["COLLECTIVE"]
    assert "barrier is where rank 2 waits now, after it went past the collective" in where.text()
    other = check_hang_report(3, "broadcast", failure)
    assert other.blamed == ["HUNG_RANK", "COLLECTIVE"] and "there is no rank 3" in other.text()
    assert "no rank waits in broadcast" in other.text()
    blank = check_hang_report(..., ..., failure)
    assert not blank.ok and not blank.failures and len(blank.missing) == 2


def test_the_reference_fix_passes_and_is_used(runs_root, no_leftovers):
    report = check_hang_fix(train_until_fixed, runs_root=runs_root)
    assert report.ok, report.text()
    assert "stopped after 3 steps" in report.text() and report.use(None) is train_until_fixed


def _train(ctx, losses, threshold, decide, summed=False, reduce=True):
    """The planted loop, its stop decided on `decide(ctx, this rank's loss)`, a number."""
    weights = torch.zeros(4)
    for step in range(losses.shape[1]):
        ctx.heartbeat(step)
        if decide(ctx, losses[ctx.rank, step].clone()) < threshold:
            break
        grad = losses[ctx.rank, step] * torch.ones(4)
        if reduce:
            dist.all_reduce(grad)
        weights -= 0.1 * grad / (1 if summed else ctx.world_size)
    if reduce:
        dist.barrier()
    return weights


def _flag(ctx, loss, op):
    flag = (loss < 0.5).float().reshape(1)
    dist.all_reduce(flag, op=op)
    return 0.0 if flag.item() else 1.0


def any_rank_stops(ctx, losses, threshold):
    return _train(ctx, losses, threshold, lambda c, loss: _flag(c, loss, dist.ReduceOp.MAX))


def every_rank_must(ctx, losses, threshold):
    return _train(ctx, losses, threshold, lambda c, loss: _flag(c, loss, dist.ReduceOp.MIN))


def rank0_decides(ctx, losses, threshold):
    def decide(c, loss):
        dist.broadcast(loss, src=0)
        return loss
    return _train(ctx, losses, threshold, decide)


def never_stops(ctx, losses, threshold):
    return _train(ctx, losses, threshold, lambda c, loss: 1.0)


def summed_gradients(ctx, losses, threshold):
    def decide(c, loss):
        dist.all_reduce(loss)
        return loss / c.world_size
    return _train(ctx, losses, threshold, decide, summed=True)


def no_collectives(ctx, losses, threshold):
    """Every collective taken out: nothing hangs, and each rank stops on its own."""
    return _train(ctx, losses, threshold, lambda c, loss: loss, reduce=False)


def test_each_wrong_fix_is_named_by_where_it_stopped(runs_root, no_leftovers):
    for fn, words in [(any_rank_stops, "stopped after 2 steps, when some rank's loss"),
                      (every_rank_must, "stopped after 5 steps, when every rank's loss"),
                      (rank0_decides, "stopped after 4 steps, when rank 0's loss alone"),
                      (never_stops, "trained all 6 steps: it never stopped"),
                      (summed_gradients, "the gradients are summed, not averaged"),
                      (no_collectives, "the ranks ended with different weights")]:
        report = check_hang_fix(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def gathered_mean(ctx, losses, threshold):
    """A correct fix written another way: every rank gathers all losses and takes the mean."""
    weights = torch.zeros(4)
    for step in range(losses.shape[1]):
        ctx.heartbeat(step)
        every = [torch.zeros(()) for _ in range(ctx.world_size)]
        dist.all_gather(every, losses[ctx.rank, step].clone())
        if torch.stack(every).mean() < threshold:
            break
        grad = losses[ctx.rank, step] * torch.ones(4)
        dist.all_reduce(grad)
        weights -= 0.1 * grad / ctx.world_size
    return weights


def test_a_fix_written_another_way_passes(runs_root, no_leftovers):
    report = check_hang_fix(gathered_mean, runs_root=runs_root)
    assert report.ok, report.text()


def still_hangs(ctx, losses, threshold):
    """The planted script, unfixed: rank 1 stops on its own loss and waits in the barrier."""
    weights = torch.zeros(4)
    for step in range(losses.shape[1]):
        ctx.heartbeat(step)
        if losses[ctx.rank, step] < threshold:
            break
        grad = losses[ctx.rank, step] * torch.ones(4)
        dist.all_reduce(grad)
        weights -= 0.1 * grad / ctx.world_size
    dist.barrier()
    return weights


def test_a_fix_that_still_hangs_is_reported_within_30_s_at_each_ranks_line(runs_root,
                                                                           no_leftovers):
    started = time.monotonic()
    report = check_hang_fix(still_hangs, timeout=4, runs_root=runs_root)
    assert time.monotonic() - started < 30
    text = report.text()
    assert not report.ok and report.blamed == ["still_hangs"], text
    assert "rank 0 waits in all_reduce at test_exercises_hang.py" in text, text
    assert "rank 1 waits in barrier at test_exercises_hang.py" in text, text
    assert "all-reduce the loss first" in text, text


def stub(ctx, losses, threshold):
    raise NotImplementedError("my_train_until is not written yet")


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(runs_root, no_leftovers,
                                                                  monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    report = check_hang_fix(stub, runs_root=runs_root)
    assert not report.ok and not report.failures
    assert "my_train_until is not written yet" in report.text()
    assert report.use(train_until_fixed) is train_until_fixed
