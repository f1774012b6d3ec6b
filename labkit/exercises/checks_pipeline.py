"""Check a hand-written two-stage pipeline step (1F1B with send/recv) on two gloo ranks against the unsplit model.

    report = check_pipeline(my_1f1b)                 # 4 microbatches; the interface is in pipe_rank.py
    report.ok, report.failures, report.measured      # measured: most_held (stage 0), grad_rel_diff
    my_1f1b = report.use(one_f_one_b)                # yours if it passed (blank mode: the reference)

What is checked, each from what the run did:
    runs         the step finished within `timeout` seconds; a deadlock is reported by what each stage was
                 waiting for (both receiving, nobody sending: the order is wrong)
    gradients    each stage's gradients equal the unsplit model's on the whole batch (relative 1e-5); else the
                 typical mistakes are told apart: m times too large (each microbatch's loss not divided by m),
                 one microbatch's gradient only (not accumulated: gradients zeroed between microbatches), none
    in flight    stage 0 held at most 2 activations at once (p = 2): 1F1B; all m is GPipe's order
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..rundir import RunDir
from ..training.parallel.pipestep import read_now
from .learner import run_checked
from .pipe_rank import Stage, Wire, drive_pipeline
from .report import Report

RTOL = 1e-5
STAGES = 2


def one_f_one_b(stage: Stage, wire: Wire) -> None:
    """The reference: 1F1B for two stages. Stage 0 runs 2 forwards ahead, then one backward per forward."""
    m = stage.m
    if stage.rank == 0:
        outputs = {}
        for i in range(min(STAGES, m)):                  # warm-up: as many forwards as there are stages
            outputs[i] = stage.forward(i)
            wire.send(outputs[i])
        for i in range(m):                               # steady state, then cool-down
            outputs.pop(i).backward(wire.recv())         # accumulates into .grad over the microbatches
            if i + STAGES < m:
                outputs[i + STAGES] = stage.forward(i + STAGES)
                wire.send(outputs[i + STAGES])
    else:
        for i in range(m):                               # the last stage: each forward straight into its backward
            x = wire.recv().requires_grad_()
            (stage.forward(i, x) / m).backward()         # the mean over the whole batch: divide by m
            wire.send(x.grad)


def check_pipeline(step: Any, *, microbatches: int = 4, timeout: float = 10.0, runs_root: Any = None) -> Report:
    """Run `step(stage, wire)` on 2 gloo ranks with `microbatches` microbatches and report what is right and
    wrong with it:  check_pipeline(one_f_one_b).ok."""
    name = getattr(step, "__name__", repr(step))
    report = Report(f"{name}: a 2-stage pipeline step, {microbatches} microbatches, on 2 gloo ranks",
                    implementation=step)
    outcomes = run_checked(report, functools.partial(drive_pipeline, step=step, microbatches=microbatches),
                           world_size=2, timeout=timeout, name=f"check-{name}", runs_root=runs_root)
    if outcomes is None:
        _explain_deadlock(report)
        return report
    report.add("runs", "pass", f"the step finished on both ranks ({len(outcomes[0]['log'])} sends and receives "
                               "on stage 0)")
    check_stage_gradients(report, outcomes, microbatches)
    check_in_flight(report, outcomes[0], microbatches)
    return report


def _explain_deadlock(report: Report) -> None:
    if report.run_dir is None:
        return
    where = {r: read_now(RunDir(report.run_dir).wire_now(r)) for r in range(STAGES)}
    if all("waiting in recv" in text for text in where.values()):
        report.add("order", "fail", f"deadlock: {where[0]}; {where[1]}. Both stages receive and neither sends: "
                   "stage 0 must send the activations of its first forwards before it waits for a gradient")


def check_stage_gradients(report: Report, outcomes: list[dict[str, Any]], m: int) -> None:
    """Each stage's gradients against the unsplit model's: equal, or which typical mistake they show."""
    worst = 0.0
    for out in outcomes:
        rank, ref = out["rank"], out["reference"]
        whole = ref["whole"][rank]
        for name, want in whole.items():
            got, micro = out["grads"][name], [grads[rank][name] for grads in ref["micro"]]
            where = f"stage {rank}'s {name}"
            if got is None:
                report.add("gradients", "fail", f"{where} has no gradient after the step: every microbatch's "
                           "backward must reach it (on stage 0, backward(grad) with the gradient received)")
                return
            if _close(got, want):
                worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
                continue
            if _close(got, want * m):
                report.add("gradients", "fail", f"{where} is {m}x the unsplit model's: divide each microbatch's "
                           f"loss by the number of microbatches (m = {m}) before backward, so that the sum of "
                           "the m backwards is the whole batch's mean")
            elif any(_close(got, g / m) or _close(got, g) for g in micro):
                k = next(i for i, g in enumerate(micro) if _close(got, g / m) or _close(got, g))
                report.add("gradients", "fail", f"{where} is microbatch {k}'s gradient alone: the gradients were "
                           "not accumulated over the microbatches (zeroed or replaced between them); let every "
                           "backward add into .grad and zero only once per step")
            else:
                ratio = (got * want).sum().item() / max((want * want).sum().item(), 1e-30)
                report.add("gradients", "fail", f"{where} differs from the unsplit model's (projection ratio "
                           f"{ratio:.3f}, largest difference {(got - want).abs().max().item():.3g})")
            return
    report.measured["grad_rel_diff"] = worst
    report.add("gradients", "pass", f"both stages' gradients equal the unsplit model's on the whole batch "
                                    f"(largest relative difference {worst:.1e})")


def check_in_flight(report: Report, stage0: dict[str, Any], m: int) -> None:
    """1F1B keeps at most as many microbatches in flight on stage 0 as there are stages."""
    most = stage0["most_held"]
    report.measured["most_held"] = most
    if most <= STAGES:
        report.add("in flight", "pass", f"stage 0 held at most {most} activations at once (1F1B: at most p = "
                                        f"{STAGES}; GPipe would hold all {m})")
    elif most == m:
        report.add("in flight", "fail", f"stage 0 held all {m} activations at once: that is GPipe's order (every "
                   f"forward before the first backward). 1F1B runs a backward as soon as its gradient can come "
                   f"back, holding at most {STAGES}")
    else:
        report.add("in flight", "fail", f"stage 0 held {most} activations at once; 1F1B holds at most {STAGES}")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=RTOL * max(b.abs().max().item(), 1e-12))
