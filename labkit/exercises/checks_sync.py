"""Local SGD's periodic average, written by the learner (lesson 06), checked on 2 and 3 gloo ranks.

    def average_parameters(model, step, period):   # after optimizer.step(), on every rank
        ...                                         # at steps 0, k, 2k, ...: each parameter's mean
    report = check_average(average_parameters)      # 2 and 3 ranks, each on its own data
    average_parameters = report.use(reference_average)

The checker trains a small model on each rank, each on its own batches, and calls the learner's
function after every optimizer step; it keeps each rank's parameters (and gradients) just before and
just after the call. The reference is no code of the learner's path: the mean of the ranks'
parameters is taken in the checker's process from what the ranks returned, and the steps that must
average follow torch's PeriodicModelAverager (step % period == 0, from step 0). Each step's outcome
is read as one of: the mean, the sum, unchanged, the gradients averaged.

    runs      every rank finished (a raise names the rank and the learner's line; a hang, each
              rank's place: a collective only some ranks make)
    values    right after an averaging step every rank holds the mean of the ranks' parameters (the
              sum is said with its factor; a parameter left out is named); between, each its own
    schedule  the averaging steps are exactly 0, k, 2k, ... (every step, or one step off, said so)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .learner import learner_part, run_checked
from .report import Report

RTOL, ATOL = 1e-5, 1e-6



def reference_average(model: torch.nn.Module, step: int, period: int) -> None:
    """Every `period` steps (steps 0, period, 2 * period, ...): each parameter becomes its mean
    over the ranks."""
    if step % period == 0:
        for p in model.parameters():
            dist.all_reduce(p.data)  # the sum over the ranks (ReduceOp.AVG is not on every backend)
            p.data /= dist.get_world_size()


def averaging_steps(period: int, steps: int) -> list[int]:
    """The steps torch's PeriodicModelAverager averages at (warmup 0): its counter starts at 0,
    and it averages when counter % period == 0."""
    return [s for s in range(steps) if s % period == 0]


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _snap(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad if grads else p).detach().clone()
        for n, p in model.named_parameters()
        if not grads or p.grad is not None
    }


def _drive_average(
    ctx: Any, fn: Callable, period: int, steps: int, name: str
) -> list[dict[str, Any]]:
    own = (
        dist.new_group()
    )  # the checker's own group: its barrier never pairs with the learner's collectives
    torch.manual_seed(0)  # the same start on every rank
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(
        100 + ctx.rank
    )  # each rank its own batches: the ranks drift apart
    out = []
    for step in range(steps):
        ctx.heartbeat(step)
        x = torch.randn(8, 6, generator=data)
        opt.zero_grad()
        F.mse_loss(model(x), x[:, :2] * (1 + ctx.rank)).backward()
        opt.step()
        before, grads = _snap(model), _snap(model, grads=True)
        with learner_part(ctx, name, step):
            fn(model, step, period)
        out.append(
            {
                "before": before,
                "after": _snap(model),
                "grads": grads,
                "grads_after": _snap(model, grads=True),
            }
        )
    dist.barrier(
        group=own
    )  # a rank done early waits here, so a rank left in a collective is seen to hang
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _outcome(step: int, outcomes: list[list[dict]]) -> tuple[str, Any]:
    """What the learner's call did at `step`, read the same on every rank: ("mean" | "sum" |
    "kept" | "grads" | "divided" | "partial" | "other", detail)."""
    world = len(outcomes)
    rows = [o[step] for o in outcomes]
    names = list(rows[0]["before"])
    mean = {n: torch.stack([r["before"][n] for r in rows]).mean(0) for n in names}
    total = {n: mean[n] * world for n in names}
    per_name = {}
    for n in names:
        afters = [r["after"][n] for r in rows]
        if all(_close(a, mean[n]) for a in afters):
            per_name[n] = "mean"
        elif all(_close(a, total[n]) for a in afters):
            per_name[n] = "sum"
        elif all(torch.equal(a, r["before"][n]) for a, r in zip(afters, rows)):
            per_name[n] = "kept"
        elif all(_close(a, r["before"][n] / world) for a, r in zip(afters, rows)):
            per_name[n] = "divided"   # its own, divided: no all-reduce, or one on a copy
        else:
            per_name[n] = "other"
    kinds = set(per_name.values())
    if kinds == {"kept"}:
        gmean = {n: torch.stack([r["grads"][n] for r in rows]).mean(0) for n in rows[0]["grads"]}
        if gmean and all(
            _close(r["grads_after"].get(n, torch.empty(0)), gmean[n]) for r in rows for n in gmean
        ):
            return "grads", None
        return "kept", None
    if kinds == {"mean"}:
        return "mean", None
    if "sum" in kinds:
        n = next(n for n, k in per_name.items() if k == "sum")
        a, m = rows[0]["after"][n].flatten(), mean[n].flatten()
        return "sum", float(a @ m / (m @ m))
    if kinds == {"divided"}:
        return "divided", None
    if kinds <= {"mean", "kept"}:
        return "partial", [n for n, k in per_name.items() if k == "kept"]
    rank = next(
        r for r, row in enumerate(rows) if not all(_close(row["after"][n], mean[n]) for n in names)
    )
    return "other", rank


def check_average(
    fn: Callable,
    *,
    worlds: tuple[int, ...] = (2, 3),
    period: int = 4,
    steps: int = 12,
    timeout: float = 15.0,
    runs_root: Any = None,
) -> Report:
    """Run `fn(model, step, period)` after each optimizer step on each world size:
    check_average(fn).ok."""
    name = getattr(fn, "__name__", "your average")
    report = Report(
        f"{name}: local SGD's average every {period} steps, on {' and '.join(map(str, worlds))} "
        "gloo ranks",
        implementation=fn,
    )
    for world in worlds:
        outcomes = run_checked(
            report,
            functools.partial(_drive_average, fn=fn, period=period, steps=steps, name=name),
            world_size=world,
            timeout=timeout,
            name=f"check-{name}-{world}",
            runs_root=runs_root,
            hang_hint="Every rank must make the same all-reduces in the same order: decide "
            "to average from the step and the period alone, never from the rank.",
        )
        if outcomes is None or not _judge_average(report, outcomes, world, period, steps, name):
            return report
    return report


def _judge_average(
    report: Report, outcomes: list, world: int, period: int, steps: int, name: str
) -> bool:
    want = averaging_steps(period, steps)
    read = {s: _outcome(s, outcomes) for s in range(steps)}

    def fail(check: str, message: str) -> bool:
        report.add(check, "fail", f"{world} ranks: {message}", part=name)
        return False

    for s, (kind, detail) in read.items():
        if kind == "sum":
            return fail(
                "values",
                f"after step {s} every rank holds {detail:.3f}x the mean of the ranks' "
                f"parameters: the sum. Divide by the world size ({world}) after the "
                "all-reduce (or use ReduceOp.AVG)",
            )
        if kind == "partial":
            return fail(
                "values",
                f"after step {s} the ranks agree on some parameters, not on {detail}: "
                "average every tensor of model.parameters()",
            )
        if kind == "divided":
            return fail(
                "values",
                f"after step {s} every rank holds its own parameters divided by {world}: the "
                "all-reduce is missing, or it ran on a copy of p.data instead of p.data itself",
            )
        if kind == "other":
            return fail(
                "values",
                f"after step {s} rank {detail}'s parameters are neither its own nor the mean "
                "of the ranks' (all-reduce, then divide by the world size, in place on p.data)",
            )
    done = [s for s, (kind, _) in read.items() if kind == "mean"]
    grads = [s for s, (kind, _) in read.items() if kind == "grads"]
    if done == want:
        report.add(
            "values",
            "pass",
            f"{world} ranks: right after each averaging every rank holds the mean of "
            "the ranks' parameters; between, each rank keeps its own",
        )
        report.add(
            "schedule", "pass", f"{world} ranks: averaged at steps {want} of {steps}, torch's rule"
        )
        return True
    if not done and grads:
        return fail(
            "values",
            f"at steps {grads} the gradients were averaged, not the parameters: after "
            "optimizer.step() the gradients are spent, and the ranks keep different "
            "parameters. All-reduce p.data",
        )
    if not done:
        return fail(
            "values",
            f"no step left the ranks equal (want equal after steps {want}): the parameters "
            "were never averaged",
        )
    if len(done) == steps:
        return fail(
            "schedule",
            f"averaged at every step ({steps} of {steps}), want only steps {want}: the "
            f"period ({period}) is ignored; average when step % period == 0",
        )
    phase = {s % period for s in done}
    if len(phase) == 1 and len(done) >= len(want) - 1 and phase.pop() in (1, period - 1):
        return fail(
            "schedule",
            f"averaged at steps {done}, want {want}: off by one step. torch's "
            "PeriodicModelAverager averages when step % period == 0, from step 0",
        )
    return fail("schedule", f"averaged at steps {done}, want {want} (step % period == 0)")
