"""The linear scaling rule with warmup, written by the learner as a pure function, checked at many
(world, step) points and on 2 real gloo ranks (lesson 03).

    def lr_at(step, base_lr, base_batch, per_rank_batch, world, warmup_steps):
        ...                              # the learning rate of optimizer step `step` (0-based)
    report = check_lr_at(lr_at)
    lr_at = report.use(scaled_lr)        # yours if it passed

The rule (Goyal et al. 2017) multiplies base_lr by k = global batch / base_batch, the global batch
being per_rank_batch x world (per_rank_batch: the samples one rank puts into one optimizer step,
accumulation included). The warmup is labkit's, the one run C of lesson 03 ran: step s <
warmup_steps runs at peak x (s + 1) / warmup_steps, then the peak (warmup_steps = 0: the peak from
step 0). The checker compares with labkit's own schedule (training/lr.py's lr_at,
scaling.linear_scaling_lr), not with `scaled_lr`.

    values   every (world, step) point of a grid is the rule's LR; a wrong one is read as the usual
             slip that gives the same numbers everywhere: the per-rank batch for the global one, the
             warmup off by one step (from 0, or one step too long), no warmup, Goyal's ramp from
             base_lr, the square-root rule
    ranks    on 2 gloo ranks, each rank computes the LR of each step from its own world size and
             trains a DDP replica with it: every rank must compute the same LRs, or replicas part
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..training.lr import lr_at as labkit_lr_at
from ..tricks.scaling import linear_scaling_lr
from .learner import learner_part, run_checked
from .report import Report

REL = 1e-6
BASE_LR, BASE_BATCH, PER_RANK = (
    0.03,
    32,
    32,
)  # k = world: lesson 03's A at 2 ranks x 16 is base batch 32
WORLDS, WARMUPS = (1, 2, 4, 8), (5, 1, 0)


def scaled_lr(
    step: int, base_lr: float, base_batch: int, per_rank_batch: int, world: int, warmup_steps: int
) -> float:
    """labkit's reference: base_lr x (per_rank_batch x world / base_batch), warmed up from
    peak / warmup_steps."""
    peak = base_lr * per_rank_batch * world / base_batch
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return peak


def _want(
    step: int, base_lr: float, base_batch: int, per_rank_batch: int, world: int, warmup_steps: int
) -> float:
    """The rule from labkit's own schedule code (independent of scaled_lr): run C's LRs."""
    peak = linear_scaling_lr(base_lr, base_batch, per_rank_batch * world)
    return labkit_lr_at(step, peak=peak, steps=10_000, warmup_steps=warmup_steps)


def _grid() -> list[tuple[int, int, int]]:
    """(world, warmup_steps, step): every world at the warmup's first, last steps and after it."""
    points = []
    for world in WORLDS:
        for warmup in WARMUPS:
            steps = sorted({0, 1, max(warmup - 1, 0), warmup, warmup + 1, warmup + 7})
            points += [(world, warmup, step) for step in steps]
    return points


def _slips() -> dict[str, Callable[..., float]]:
    """Wrong rules a learner writes, each with the sentence that names it (tried in this order).
    Arguments: step, base_lr, base_batch, per_rank_batch, world, warmup_steps."""

    def peak(b: float, bb: int, p: int, w: int) -> float:
        return b * p * w / bb

    def ramp(s: int, wu: int) -> float:
        return (s + 1) / wu if s < wu else 1.0

    per_rank = (
        "the per-rank batch was used where the global batch (per_rank_batch x world) belongs: "
        "the LR does not grow with the world size"
    )
    no_warmup = (
        "no warmup: the peak LR from step 0 "
        "(step s < warmup_steps runs at peak x (s + 1) / warmup_steps)"
    )
    from_zero = (
        "the warmup is off by one: it starts at 0 (peak x s / warmup_steps), so step 0 does not "
        "train; labkit's step 0 runs at peak / warmup_steps"
    )
    too_long = (
        "the warmup is off by one: it runs one step too long (step warmup_steps overshoots the "
        "peak, (warmup_steps + 1) / warmup_steps of it); warmup covers steps 0 .. warmup_steps - 1"
    )
    goyal = (
        "that is Goyal et al.'s ramp, from base_lr up to the peak; this exercise asks labkit's "
        "(the one run C ran): from peak / warmup_steps"
    )
    root = (
        "the square-root rule (base_lr x sqrt(k)); the linear rule multiplies base_lr by "
        "k = global / base batch"
    )
    return {
        per_rank: lambda s, b, bb, p, w, wu: b * p / bb * ramp(s, wu),
        no_warmup: lambda s, b, bb, p, w, wu: peak(b, bb, p, w),
        from_zero: lambda s, b, bb, p, w, wu: peak(b, bb, p, w) * (s / wu if s < wu else 1.0),
        too_long: lambda s, b, bb, p, w, wu: peak(b, bb, p, w) * ((s + 1) / wu if s <= wu else 1),
        goyal: lambda s, b, bb, p, w, wu: b + (peak(b, bb, p, w) - b) * (s / wu if s < wu else 1),
        root: lambda s, b, bb, p, w, wu: b * math.sqrt(p * w / bb) * ramp(s, wu),
    }


def _close(a: Any, b: float) -> bool:
    try:
        return abs(float(a) - b) <= REL * max(abs(b), 1e-12)
    except (TypeError, ValueError):
        return False


def _drive(ctx: Any, fn: Callable, name: str, warmup: int) -> dict[str, Any]:
    """One rank: the grid, then a DDP replica trained with the LR this rank computes for its own
    world size."""
    with learner_part(ctx, name):
        grid = [fn(s, BASE_LR, BASE_BATCH, PER_RANK, w, wu) for w, wu, s in _grid()]
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    data = torch.Generator().manual_seed(ctx.rank)
    lrs = []
    for step in range(warmup + 2):
        with learner_part(ctx, name, step):
            lr = float(fn(step, BASE_LR, BASE_BATCH, PER_RANK, dist.get_world_size(), warmup))
        lrs.append(lr)
        for group in opt.param_groups:
            group["lr"] = lr
        x = torch.randn(8, 4, generator=data)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ctx.record(step, lr=lr)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(ctx.world_size)]
    dist.all_gather(every, weights)
    return {
        "grid": grid,
        "lrs": lrs,
        "weights_gap": max(float((w - weights).abs().max()) for w in every),
    }


def check_lr_at(
    fn: Callable, *, world: int = 2, warmup: int = 3, timeout: float = 20.0, runs_root: Any = None
) -> Report:
    """Run `fn` on the grid and on `world` gloo ranks, and report:  check_lr_at(lr_at).ok."""
    name = getattr(fn, "__name__", "lr_at")
    report = Report(
        f"{name}: the linear scaling rule with warmup, at {len(WORLDS)} world sizes and on {world} "
        "gloo ranks",
        implementation=fn,
    )
    outcomes = run_checked(
        report,
        functools.partial(_drive, fn=fn, name=name, warmup=warmup),
        world_size=world,
        timeout=timeout,
        name=f"check-{name}",
        runs_root=runs_root,
        hang_hint="Your function computes a number: it needs no collective, and should not "
        "call one.",
    )
    if outcomes is None or not _agree(report, outcomes, name):
        return report
    if _values(report, outcomes[0]["grid"], name):
        _trained(report, outcomes, world, warmup, name)
    return report


def _agree(report: Report, outcomes: list[dict], name: str) -> bool:
    """Every rank computed the same numbers: a rule that reads the rank parts the replicas."""
    for key in ("grid", "lrs"):
        for i, values in enumerate(zip(*(o[key] for o in outcomes))):
            said = {rank: v for rank, v in enumerate(values)}
            if len(set(map(repr, values))) > 1:
                where = (
                    f"world {_grid()[i][0]}, step {_grid()[i][2]}, warmup_steps {_grid()[i][1]}"
                    if key == "grid"
                    else f"training step {i}"
                )
                report.add(
                    "ranks",
                    "fail",
                    f"at {where} the ranks computed different LRs ({said}): the LR "
                    "must depend on the world size, never on the rank, or the replicas "
                    "part (their weights ended "
                    f"{max(o['weights_gap'] for o in outcomes):.2g} apart)",
                    part=name,
                )
                return False
    return True


def _values(report: Report, got: list[Any], name: str) -> bool:
    points = _grid()
    args = [(s, BASE_LR, BASE_BATCH, PER_RANK, w, wu) for w, wu, s in points]
    want = [_want(*a) for a in args]
    wrong = [i for i, (g, v) in enumerate(zip(got, want)) if not _close(g, v)]
    report.measured["points"] = len(points)
    if not wrong:
        report.add(
            "values",
            "pass",
            f"all {len(points)} (world, step) points are base_lr x global/base batch, "
            "warmed up from peak / warmup_steps",
        )
        return True
    for why, slip in _slips().items():
        if all(_close(g, _safe(slip, a)) for g, a in zip(got, args) if _safe(slip, a) is not None):
            report.add("values", "fail", why, part=name)
            return False
    i = wrong[0]
    step, _, _, _, world, warmup = args[i]
    report.add(
        "values",
        "fail",
        f"world {world}, step {step}, warmup_steps {warmup} (base_lr {BASE_LR}, base "
        f"batch {BASE_BATCH}, {PER_RANK} per rank): your LR is {got[i]!r}, the rule's "
        f"{want[i]:.6g} ({len(wrong)} of {len(points)} points wrong)",
        part=name,
    )
    return False


def _safe(slip: Callable, args: tuple) -> float | None:
    try:
        return slip(*args)
    except ZeroDivisionError:
        return None  # warmup_steps = 0 in a slip's ramp: that point cannot tell


def _trained(report: Report, outcomes: list[dict], world: int, warmup: int, name: str) -> None:
    lrs = [o["lrs"] for o in outcomes]
    want = [_want(s, BASE_LR, BASE_BATCH, PER_RANK, world, warmup) for s in range(warmup + 2)]
    if not all(_close(g, v) for g, v in zip(lrs[0], want)):
        report.add(
            "ranks",
            "fail",
            f"on {world} ranks the LRs were {lrs[0]}, the rule's {want}: read the world "
            "size from the argument you are given",
            part=name,
        )
        return
    report.measured["lrs"] = lrs[0]
    report.add(
        "ranks",
        "pass",
        f"on {world} gloo ranks every rank computed the same LRs "
        f"({', '.join(f'{v:.3g}' for v in lrs[0])}), and the DDP replicas stayed equal",
    )
