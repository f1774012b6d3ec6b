"""ReduceLROnPlateau fed the held-out loss averaged over the ranks (lesson 10), on 2 gloo ranks.

    def plateau_step(scheduler, local_val_loss):   # once per evaluation, on every rank
        ...                                         # the mean over the ranks, then scheduler.step
    report = check_plateau(plateau_step)
    plateau_step = report.use(reference_plateau_step)

Each rank holds a ReduceLROnPlateau of its own and, at each of several epochs, a held-out loss of
its own (a 0-dim tensor): the ranks' losses are chosen so that a scheduler fed one rank's loss, or
the sum, or stepped twice an epoch, cuts the LR at other epochs than one fed the mean. The
reference is one process's scheduler, with the same settings, fed the true mean of each epoch's
losses. The checker records each rank's LR after every epoch, and what the learner handed to
scheduler.step (a spy on the scheduler, so a wrong feed is named even where its LRs look alike).

    runs    every rank finished (a raise names the rank and the learner's line; a hang, each
            rank's place: an all-reduce only some ranks make)
    steps   each rank's scheduler stepped once per epoch (twice is named: patience counts steps)
    fed     every rank fed the mean of the ranks' losses (its own loss, or the sum with its
            factor, is named with the epoch where the LRs then part)
    lrs     every rank's LR after every epoch is the reference's
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from .learner import learner_part, run_checked
from .report import Report

LR = 0.1
PLATEAU = {"mode": "min", "factor": 0.5, "patience": 1, "threshold": 0.05, "threshold_mode": "abs"}
# Each epoch's held-out loss on rank 0 and rank 1. Rank 0's keeps falling, rank 1's stalls; fed the
# mean, the scheduler cuts at epochs 4 and 7; fed rank 1's, at 3 and 5; rank 0's, at 6; the sum
# (abs threshold), at 7 only; the mean twice an epoch, from 3 on. Each decision clears the threshold
# by 0.01 or more, far above float32's rounding.
HELD_OUT = ((0.60, 1.40), (0.46, 1.34), (0.30, 1.30), (0.20, 1.36), (0.12, 1.42), (0.10, 1.30),
            (0.10, 1.28), (0.03, 1.33))


def reference_plateau_step(scheduler: Any, local_val_loss: torch.Tensor) -> None:
    """Feed `scheduler` the mean over the ranks of their held-out losses (equal shards): every rank
    then makes the same decision."""
    loss = torch.as_tensor(local_val_loss, dtype=torch.float32).detach().clone().reshape(1)
    dist.all_reduce(loss)   # the sum over the ranks
    scheduler.step(loss.item() / dist.get_world_size())


def reference_lrs(held_out: tuple = HELD_OUT) -> list[float]:
    """One process, one scheduler fed each epoch's true mean: the LR after each epoch."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=LR)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **PLATEAU)
    out = []
    for row in held_out:
        scheduler.step(sum(row) / len(row))
        out.append(opt.param_groups[0]["lr"])
    return out


def _drive(ctx: Any, fn: Callable, name: str, held_out: tuple) -> dict[str, Any]:
    own = dist.new_group()   # the checker's own barrier, never paired with the learner's calls
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=LR)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **PLATEAU)
    fed: list[list[float]] = []
    stepped = scheduler.step

    def spy(*args: Any, **kwargs: Any) -> Any:   # what the learner hands the scheduler, each call
        metrics = args[0] if args else kwargs.get("metrics", math.nan)
        fed[-1].append(float(metrics))
        return stepped(*args, **kwargs)

    scheduler.step = spy   # type: ignore[method-assign]
    lrs = []
    for epoch, row in enumerate(held_out):
        ctx.heartbeat(epoch)
        fed.append([])
        with learner_part(ctx, name, epoch):
            fn(scheduler, torch.tensor(row[ctx.rank]))
        lrs.append(opt.param_groups[0]["lr"])
    dist.barrier(group=own)   # a rank done early waits here: a rank left in a collective hangs
    return {"lrs": lrs, "fed": fed}


def check_plateau(fn: Callable, *, held_out: tuple = HELD_OUT, timeout: float = 15.0,
                  runs_root: Any = None) -> Report:
    """Run `fn(scheduler, local_val_loss)` once per epoch on 2 ranks:  check_plateau(fn).ok."""
    name = getattr(fn, "__name__", "your plateau step")
    world = len(held_out[0])
    report = Report(f"{name}: ReduceLROnPlateau fed the mean held-out loss, on {world} gloo ranks",
                    implementation=fn)
    outcomes = run_checked(report, functools.partial(_drive, fn=fn, name=name, held_out=held_out),
                           world_size=world, timeout=timeout, name=f"check-{name}",
                           runs_root=runs_root,
                           hang_hint="Every rank must make the same all-reduce at every "
                                     "evaluation: one rank deciding alone leaves the others' call "
                                     "unanswered.")
    if outcomes is not None:
        _judge(report, outcomes, held_out, name)
    return report


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def _lrs_part(outcomes: list[dict], want: list[float]) -> str:
    """Where the ranks' LRs first leave the reference's, in words ("" if they never do)."""
    for epoch, ref in enumerate(want):
        got = [o["lrs"][epoch] for o in outcomes]
        if not all(_close(lr, ref) for lr in got):
            ranks = ", ".join(f"rank {r}'s {lr:g}" for r, lr in enumerate(got))
            return f"at epoch {epoch} the LRs are {ranks}, the reference's {ref:g}"
    return ""


def _judge(report: Report, outcomes: list[dict], held_out: tuple, name: str) -> None:
    world, want = len(outcomes), reference_lrs(held_out)
    parted = _lrs_part(outcomes, want)
    then = f". So {parted}" if parted else ""

    def fail(check: str, message: str) -> None:
        report.add(check, "fail", message + then, part=name)

    for epoch, row in enumerate(held_out):
        counts = [len(o["fed"][epoch]) for o in outcomes]
        if counts != [1] * world:
            rank = next(r for r, n in enumerate(counts) if n != 1)
            return fail("steps", f"rank {rank}'s scheduler stepped {counts[rank]} times at epoch "
                                 f"{epoch}: step it once per evaluation. Patience counts scheduler "
                                 "steps: extra steps cut the LR early, and a scheduler not stepped "
                                 "never cuts it")
    report.add("steps", "pass", "every rank's scheduler stepped once per epoch")
    for epoch, row in enumerate(held_out):
        mean = sum(row) / world
        got = [o["fed"][epoch][0] for o in outcomes]
        if all(_close(v, mean) for v in got):
            continue
        if all(_close(v, mean * world) for v in got):
            return fail("fed", f"every rank's scheduler was fed {got[0] / mean:.3f}x the mean "
                               f"held-out loss at epoch {epoch} ({got[0]:.3f}, the mean is "
                               f"{mean:.3f}): the sum over the {world} ranks. Divide by the world "
                               "size")
        rank = next(r for r, v in enumerate(got) if not _close(v, mean))
        if all(_close(v, row[r] / world) for r, v in enumerate(got)):
            return fail("fed", f"each rank's scheduler was fed its own held-out loss divided "
                               f"by {world} (rank {rank}: {got[rank]:.3f} at epoch {epoch}, the "
                               f"mean is {mean:.3f}): the all-reduce is missing, or it ran on a "
                               "copy of the tensor you then read")
        if all(_close(v, row[r]) for r, v in enumerate(got)):
            return fail("fed", f"each rank's scheduler was fed its own held-out loss (rank {rank}: "
                               f"{got[rank]:.3f} at epoch {epoch}, the mean over the ranks is "
                               f"{mean:.3f}), so the ranks decide apart. All-reduce the loss and "
                               "divide by the world size before scheduler.step()")
        return fail("fed", f"rank {rank}'s scheduler was fed {got[rank]:.4g} at epoch {epoch}; the "
                           f"mean of the ranks' held-out losses is {mean:.4g}")
    report.add("fed", "pass", "every rank's scheduler was fed the mean of the ranks' held-out "
                              "losses")
    if parted:
        report.add("lrs", "fail", parted[0].upper() + parted[1:], part=name)
    else:
        report.add("lrs", "pass", f"every rank's LR after each of {len(want)} epochs is the "
                                  f"reference's (cut at epochs {_cuts(want)})")


def _cuts(lrs: list[float]) -> list[int]:
    return [e for e in range(1, len(lrs)) if lrs[e] < lrs[e - 1]]
