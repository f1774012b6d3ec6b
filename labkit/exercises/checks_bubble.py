"""GPipe's and 1F1B's costs worked out before the run (lesson 18): the bubble and the microbatches
in flight, as a small pure function checked on many points and on two real gloo ranks running
torch's own schedules.

    def pipeline_costs(schedule, p, m, stage):   # "GPipe" or "1F1B", p equal stages, m microbatches
        ...                                      # -> (bubble, most microbatches whose activations
                                                 `stage` holds)
    report = check_pipeline_costs(pipeline_costs)
    report.measured["in flight"]                 # {(schedule, stage): microbatches held, counted on
                                                 the ranks}
    pipeline_costs = report.use(reference_pipeline_costs)   # yours once it passed

The formula is labkit's (training/parallel/pipetrace.py): the bubble of GPipe and 1F1B with equal
stages is (p - 1)/(m + p - 1) of the step, the same for both; GPipe keeps every microbatch's
activations on every stage until its backward (m), 1F1B at most p - s on stage s (p on the first, 1
on the last; never more than m).

    bubble     every point of a grid (p = 2..8, m from p to 32, the headline p = 8, m = 32 included)
               is the formula's; a wrong one is read as the usual slip: (p - 1)/m (idle over busy,
               not over the step), p for p - 1, 1F1B's bubble smaller than GPipe's
    in flight  every (schedule, p, m, stage) point holds the formula's count; slips named: 1F1B
               holding m (GPipe's count), p on every stage, GPipe holding p or 1
    ranks      on 2 gloo ranks, torch's ScheduleGPipe and Schedule1F1B with m = 4 each run a small
               MLP; the activations each stage held are counted (saved-tensor hooks,
               pipetrace.in_flight) and must equal your count for that rank's stage; the bubble
               measured from the ranks' action times is compared with yours within
               pipeline.TOLERANCE (a note, never a failure, when this machine's timing parts: timing
               is never judged)
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..training.parallel.pipetrace import StageTrace, gpipe_bubble, in_flight, step_summary
from ..tricks.pipeline import TOLERANCE
from .checks_formulas import close, judge_points
from .learner import learner_part, run_checked
from .report import Report

SCHEDULES = ("GPipe", "1F1B")
RANKS, MICRO, STEPS, WIDTH, ROWS = (
    2,
    4,
    3,
    384,
    512,
)  # the real run: the bubble is read from step 1 on


def reference_pipeline_costs(schedule: str, p: int, m: int, stage: int) -> tuple[float, int]:
    """labkit's reference: (the bubble, the most microbatches whose activations `stage` holds
    at once)."""
    bubble = (p - 1) / (m + p - 1)  # the same ramp up and down for both schedules
    held = m if schedule == "GPipe" else min(m, p - stage)
    return bubble, held


def _held(schedule: str, p: int, m: int, stage: int) -> int:
    """The count the checker judges by: GPipe every forward first (m); 1F1B p - stage forwards
    ahead, at most m."""
    return m if schedule == "GPipe" else min(m, p - stage)


def _grid() -> list[tuple[str, int, int, int]]:
    points = []
    for p in (2, 3, 4, 8):
        for m in sorted({p, 2 * p, 4, 32} - set(range(p))):
            for stage in sorted({0, p // 2, p - 1}):
                points += [(schedule, p, m, stage) for schedule in SCHEDULES]
    return points


def _said(case: tuple) -> str:
    schedule, p, m, stage = case
    return f"{schedule}, p = {p}, m = {m}, stage {stage}"


OVER_M = ("(p - 1)/m divides the idle slots by the m busy ones; the bubble is a share of the whole "
          "step, (p - 1)/(m + p - 1)")
P_RAMP = ("p where p - 1 belongs: the ramp up (and down) is p - 1 microbatch slots, "
          "(p - 1)/(m + p - 1)")
P_TOP = ("p where p - 1 belongs in the numerator: p - 1 stages wait during the ramp, "
         "(p - 1)/(m + p - 1)")
_BUBBLE_SLIPS: dict[str, Callable[..., float]] = {
    OVER_M: lambda s, p, m, st: (p - 1) / m,
    P_RAMP: lambda s, p, m, st: p / (m + p),
    P_TOP: lambda s, p, m, st: p / (m + p - 1),
}

HOLDS_M = ("1F1B holds m microbatches here, GPipe's count: 1F1B starts each backward as soon as "
           "its gradient comes back, so stage s holds at most p - s (p on the first stage), "
           "however large m is")
HOLDS_P = ("1F1B holds p on every stage here: stage s runs only p - s forwards ahead (the last "
           "stage 1: its backward follows its forward)")
OFF_BY_ONE = ("1F1B's count is off by one: stage s holds p - s, not p - s - 1 (the first stage p, "
              "the last 1)")
GPIPE_P = ("GPipe holds p here: GPipe runs every forward before any backward, so every stage holds "
           "all m")
GPIPE_1 = ("GPipe holds 1 here: GPipe runs every forward before any backward, so every stage holds "
           "all m")
_HELD_SLIPS: dict[str, Callable[..., float]] = {
    HOLDS_M: lambda s, p, m, st: m,
    HOLDS_P: lambda s, p, m, st: m if s == "GPipe" else min(m, p),
    OFF_BY_ONE: lambda s, p, m, st: m if s == "GPipe" else min(m, p - st - 1),
    GPIPE_P: lambda s, p, m, st: p if s == "GPipe" else min(m, p - st),
    GPIPE_1: lambda s, p, m, st: 1 if s == "GPipe" else min(m, p - st),
}


def _run_schedule(ctx: Any, schedule_cls: Any) -> list[list]:
    """One stage of a two-stage MLP under torch's schedule; the actions (pipetrace) of each step
    after the first."""
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, 1),
    )
    part = model[:4] if ctx.rank == 0 else model[4:]
    stage = PipelineStage(part, ctx.rank, ctx.world_size, ctx.device)
    pipe = schedule_cls(stage, n_microbatches=MICRO, loss_fn=F.mse_loss)
    trace = StageTrace()
    trace.watch(stage)
    trace.watch_loss(pipe)
    x, y = torch.randn(ROWS, 32), torch.randn(ROWS, 1)
    steps = []
    for _ in range(STEPS):
        pipe.step(x) if ctx.rank == 0 else pipe.step(target=y, losses=[])
        steps.append(trace.take())
    return steps[1:]  # the first step also infers the shapes


def _drive(ctx: Any, fn: Callable, name: str) -> dict[str, Any]:
    with learner_part(ctx, name):
        grid = [tuple(fn(*case)) for case in _grid()]
        mine = {s: tuple(fn(s, ctx.world_size, MICRO, ctx.rank)) for s in SCHEDULES}
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    ran = {s: _run_schedule(ctx, cls) for s, cls in zip(SCHEDULES, (ScheduleGPipe, Schedule1F1B))}
    return {"grid": grid, "mine": mine, "ran": ran}


def check_pipeline_costs(fn: Callable, *, timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Judge `fn(schedule, p, m, stage)` on the grid and on 2 gloo ranks:
    check_pipeline_costs(f).ok."""
    name = getattr(fn, "__name__", "pipeline_costs")
    report = Report(
        f"{name}: the bubble and the microbatches in flight of GPipe and 1F1B, on {len(_grid())} "
        f"points and {RANKS} gloo ranks",
        implementation=fn,
    )
    outcomes = run_checked(
        report,
        functools.partial(_drive, fn=fn, name=name),
        world_size=RANKS,
        timeout=timeout,
        name=f"check-{name}",
        runs_root=runs_root,
        hang_hint="Your function computes two numbers: it needs no collective, and should "
        "not call one.",
    )
    if outcomes is None:
        return report
    cases, got = _grid(), outcomes[0]["grid"]
    if any(len(g) != 2 for g in got):
        report.add(
            "bubble", "fail", "return two numbers, (bubble, microbatches in flight)", part=name
        )
        return report
    want_bubble = [gpipe_bubble(p, m) for _, p, m, _ in cases]
    bubble_ok = _one_f_one_b_not_smaller(report, cases, got, want_bubble, name) and judge_points(
        report,
        "bubble",
        name,
        cases,
        [g[0] for g in got],
        want_bubble,
        _BUBBLE_SLIPS,
        _said,
        "bubble",
    )
    held_ok = judge_points(
        report,
        "in flight",
        name,
        cases,
        [g[1] for g in got],
        [_held(*c) for c in cases],
        _HELD_SLIPS,
        _said,
        "count of microbatches in flight",
    )
    if bubble_ok and held_ok:
        _ranks(report, outcomes, name)
    return report


def _one_f_one_b_not_smaller(
    report: Report, cases: list, got: list, want: list[float], name: str
) -> bool:
    """GPipe's points right, 1F1B's all below them: the classic claim that 1F1B shrinks the
    bubble."""
    gpipe = [close(g[0], w) for c, g, w in zip(cases, got, want) if c[0] == "GPipe"]
    ofob = [(g[0], w) for c, g, w in zip(cases, got, want) if c[0] == "1F1B"]
    try:
        smaller = all(float(g) < w - 1e-9 for g, w in ofob)
    except (TypeError, ValueError):
        return True
    if all(gpipe) and smaller:
        report.add(
            "bubble",
            "fail",
            "your 1F1B bubble is smaller than GPipe's: 1F1B has the same ramp up and down, "
            "so the same bubble, (p - 1)/(m + p - 1); it saves activations, not time",
            part=name,
        )
        return False
    return True


def _ranks(report: Report, outcomes: list[dict], name: str) -> None:
    counted, measured = {}, {}
    for schedule in SCHEDULES:
        steps = [
            {rank: out["ran"][schedule][i] for rank, out in enumerate(outcomes)}
            for i in range(STEPS - 1)
        ]
        for rank, out in enumerate(outcomes):
            held = max(in_flight(step[rank])[rank][0] for step in steps)
            counted[(schedule, rank)] = held
            yours = out["mine"][schedule][1]
            if not close(yours, held):
                report.add(
                    "ranks",
                    "fail",
                    f"{schedule}, p = {RANKS}, m = {MICRO}: stage {rank} held {held} "
                    f"microbatches at once on the real ranks, your count says {yours}",
                    part=name,
                )
                return
        measured[schedule] = statistics.median(step_summary(step)["bubble"] for step in steps)
    report.measured.update({"in flight": counted, "bubble": measured})
    said = ", ".join(f"{s} stage {r}: {n}" for (s, r), n in counted.items())
    report.add(
        "ranks",
        "pass",
        f"torch's schedules on {RANKS} gloo ranks (m = {MICRO}) held what you said ({said})",
    )
    want = gpipe_bubble(RANKS, MICRO)
    apart = {s: abs(b - want) for s, b in measured.items()}
    status = "pass" if max(apart.values()) <= TOLERANCE else "note"
    bubbles = ", ".join(f"{s} {b:.3f}" for s, b in measured.items())
    report.add(
        "measured bubble",
        status,
        f"the ranks' measured bubbles ({bubbles}) against your {want:.3f}"
        + (
            f", within {TOLERANCE}"
            if status == "pass"
            else ": this machine's timing parts from the model "
            "here (messages, busy cores); the model is what was asked for"
        ),
    )
