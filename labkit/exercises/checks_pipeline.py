"""Check a hand-written two-stage pipeline step (1F1B with send/recv) on two gloo ranks against the unsplit model.

    report = check_pipeline(my_1f1b)                 # 4 microbatches; the interface is in pipe_rank.py
    report.ok, report.failures, report.measured      # measured: most_held (stage 0), grad_rel_diff
    my_1f1b = report.use(one_f_one_b)                # yours if it passed (blank mode: the reference)

What is checked, each from what the run did; every failure names your function (part=its name) and the stage
and step (forward or backward, send or receive) that is wrong:
    runs         the step finished within `timeout` seconds; a hang names each stage's line in your code and what
                 it waited for (both receiving, nobody sending: the order is wrong; one waiting for a tensor the
                 other stage returned without sending: the counts)
    flow         each stage ran each microbatch's forward once; stage 1's forward(i, x) got microbatch i's
                 activation; stage 0's backward of microbatch i got microbatch i's gradient; each stage sent and
                 received m tensors (one per microbatch each way; sends never received are counted, not hung on)
    gradients    each stage's gradients equal the unsplit model's on the whole batch (relative 1e-5); else the
                 typical mistakes are told apart: m times too large (each microbatch's loss not divided by m),
                 one microbatch's gradient only (not accumulated: gradients zeroed between microbatches), none
    in flight    stage 0 held at most 2 activations at once (p = 2): 1F1B; all m is GPipe's order
"""
from __future__ import annotations

import dataclasses
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
    outcomes = run_checked(report, functools.partial(drive_pipeline, step=step, microbatches=microbatches,
                                                     name=name),
                           world_size=2, timeout=timeout, name=f"check-{name}", runs_root=runs_root)
    if outcomes is None:
        last = report.findings[-1]
        if last.status == "fail" and not last.part:   # no stage stood in a line of yours: still, yours hung
            report.findings[-1] = dataclasses.replace(last, part=name)
        _explain_deadlock(report, name)
        return report
    report.add("runs", "pass", f"the step finished on both ranks ({len(outcomes[0]['log'])} sends and receives "
                               "on stage 0)")
    flowed = check_flow(report, outcomes, microbatches, name)
    check_stage_gradients(report, outcomes, microbatches, name, hints=flowed)
    if flowed:   # else stage 0's backwards did not run as they should, and what it held says nothing of the order
        check_in_flight(report, outcomes[0], microbatches, name)
    return report


def _explain_deadlock(report: Report, name: str) -> None:
    """What each stage was waiting for when the step hung, from the lines the wires wrote."""
    if report.run_dir is None:
        return
    where = {r: read_now(RunDir(report.run_dir).wire_now(r)) for r in range(STAGES)}
    if all("waiting in recv" in text for text in where.values()):
        report.add("order", "fail", f"deadlock: {where[0]}; {where[1]}. Both stages receive and neither sends: "
                   "stage 0 must send a microbatch's activation before it waits for its gradient (the first "
                   "forwards' before the first gradient)", part=name)
        return
    waiting = [r for r, text in where.items() if "waiting in recv" in text]
    returned = [r for r, text in where.items() if "returned after" in text]
    if waiting and returned:
        what = "an activation" if waiting[0] == 1 else "a gradient"
        report.add("sends and receives", "fail", f"{where[waiting[0]]}, but {where[returned[0]]}: stage "
                   f"{waiting[0]} waits for {what} stage {returned[0]} never sent. Each stage sends and receives "
                   "one tensor per microbatch each way (stage 0: m activations out, m gradients in)", part=name)


def check_flow(report: Report, outcomes: list[dict[str, Any]], m: int, name: str) -> bool:
    """What went between the stages: each forward once, each x and each gradient the right microbatch's, m sends and
    m receives each way. Adds a failure per step that went wrong and returns True if none did."""
    s0, s1 = outcomes[0], outcomes[1]
    bad = len(report.findings)
    for stage in (s0, s1):
        if sorted(stage["forwards"]) != list(range(m)):
            report.add("forwards", "fail", f"stage {stage['rank']} ran the forwards of microbatches "
                       f"{stage['forwards']}: each of the m = {m} microbatches' forward once on each stage", part=name)
    label = lambda who: "no microbatch's" if who[0] < 0 else f"microbatch {who[0]}'s" + (" x m" if who[1] != 1 else "")
    sent = [label(w) for w in s0["sent"]]
    for i, who in s1["acts_in"]:
        if who != (i, 1):
            report.add("stage 1 forward", "fail", f"stage 1's forward({i}, x) got {label(who)} activation as x "
                       f"(stage 0 sent, in order: {', '.join(sent)}): stage 1 must run forward(i, x) on the "
                       "activation stage 0 sent for microbatch i, receiving them in the order they were sent",
                       part=name)
            break
    for i, who in s0["grads_in"] if len(report.findings) == bad else []:   # else a consequence of the above
        if who[0] != i or who[1] not in (1, m):   # m x the gradient: the loss not divided by m, said below
            report.add("stage 0 backward", "fail", f"stage 0's backward of microbatch {i} got {label(who)} gradient "
                       f"(stage 1 sent, in order: {', '.join(label(w) for w in s1['sent'])}): out_i.backward(g) "
                       "must get the gradient stage 1 sent back for microbatch i", part=name)
            break
    for stage, peer in ((s0, s1), (s1, s0)):
        if stage["dropped"]:
            what = "activations" if peer["rank"] == 0 else "gradients"
            report.add("sends and receives", "fail", f"stage {peer['rank']} sent {len(peer['sent'])} {what} and "
                       f"stage {stage['rank']} received {stage['received']} (m = {m}): each stage sends one tensor "
                       "per microbatch, and the other receives each", part=name)
    return len(report.findings) == bad

def check_stage_gradients(report: Report, outcomes: list[dict[str, Any]], m: int, name: str = "",
                          hints: bool = True) -> None:
    """Each stage's gradients against the unsplit model's: equal, or which typical mistake they show (`hints`:
    False when the flow between the stages was already wrong, so that only the difference is said)."""
    worst = 0.0
    for out in outcomes:
        rank, ref = out["rank"], out["reference"]
        whole = ref["whole"][rank]
        for param, want in whole.items():
            got, micro = out["grads"][param], [grads[rank][param] for grads in ref["micro"]]
            where = f"stage {rank}'s {param}"
            if got is None:
                report.add("gradients", "fail", f"{where} has no gradient after the step: every microbatch's "
                           "backward must reach it (on stage 0, backward(grad) with the gradient received)", part=name)
                return
            if _close(got, want):
                worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
                continue
            if not hints:
                report.add("gradients", "fail", f"{where} differs from the unsplit model's (largest difference "
                           f"{(got - want).abs().max().item():.3g}), after the flow above went wrong", part=name)
            elif _close(got, want * m):
                report.add("gradients", "fail", f"{where} is {m}x the unsplit model's: divide each microbatch's "
                           f"loss by the number of microbatches (m = {m}) before backward, so that the sum of "
                           "the m backwards is the whole batch's mean (stage 1's backward)", part=name)
            elif any(_close(got, g / m) or _close(got, g) for g in micro):
                k = next(i for i, g in enumerate(micro) if _close(got, g / m) or _close(got, g))
                report.add("gradients", "fail", f"{where} is microbatch {k}'s gradient alone: the gradients were "
                           "not accumulated over the microbatches (zeroed or replaced between them); let every "
                           "backward add into .grad and zero only once per step", part=name)
            else:
                ratio = (got * want).sum().item() / max((want * want).sum().item(), 1e-30)
                report.add("gradients", "fail", f"{where} differs from the unsplit model's (projection ratio "
                           f"{ratio:.3f}, largest difference {(got - want).abs().max().item():.3g})", part=name)
            return
    report.measured["grad_rel_diff"] = worst
    report.add("gradients", "pass", f"both stages' gradients equal the unsplit model's on the whole batch "
                                    f"(largest relative difference {worst:.1e})")


def check_in_flight(report: Report, stage0: dict[str, Any], m: int, name: str = "") -> None:
    """1F1B keeps at most as many microbatches in flight on stage 0 as there are stages."""
    most = stage0["most_held"]
    report.measured["most_held"] = most
    if most <= STAGES:
        report.add("in flight", "pass", f"stage 0 held at most {most} activations at once (1F1B: at most p = "
                                        f"{STAGES}; GPipe would hold all {m})")
    elif most == m:
        report.add("in flight", "fail", f"stage 0 held all {m} activations at once: that is GPipe's order (every "
                   f"forward before the first backward). 1F1B runs a backward as soon as its gradient can come "
                   f"back, holding at most {STAGES}", part=name)
    else:
        report.add("in flight", "fail", f"stage 0 held {most} activations at once: its forwards ran more than "
                   f"{STAGES} microbatches ahead of its backwards; 1F1B holds at most {STAGES}", part=name)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=RTOL * max(b.abs().max().item(), 1e-12))
