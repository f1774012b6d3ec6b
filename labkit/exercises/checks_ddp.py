"""Check a hand-written DDP wrapper on real gloo ranks against one process training on the same data.

    report = check_ddp(MyDDP)                               # naive: correctness, traffic; overlap measured
    report = check_ddp(MyOverlapDDP, overlap=True)          # all-reduces must start before backward ends
    report = check_ddp(MyBucketedDDP, bucket_size_mb=0.01)  # and respect the bucket size
    report.ok, report.failures, report.measured

The wrapper is built as wrapper_cls(model) (or wrapper_cls(model, bucket_size_mb=...)) on every rank, around a
CheckNet initialised differently on each rank, then trained for a few SGD steps: forward, loss.backward(),
wrapper.finish_gradient_synchronization(), optimizer.step(). Every sentence in the report comes from something
measured in that run: parameters after construction, each rank's gradients against the single-process gradient
and against its own rows' gradient, every collective's bytes and start time against backward's end, the parameters
after the last step. What the wire carried is checked in labkit.exercises.traffic.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..measure import usable_cores
from .ddp_rank import drive_ddp
from .learner import run_checked
from .report import Report
from .traffic import check_buckets, check_overlap, check_traffic

RTOL, ATOL = 1e-4, 1e-6


def check_ddp(wrapper_cls: Any, *, world_size: int = 2, steps: int = 3, overlap: bool = False,
              bucket_size_mb: float | None = None, timeout: float = 30.0, runs_root: Any = None) -> Report:
    """Run `wrapper_cls` on `world_size` gloo ranks for `steps` steps and report what is right and wrong with it:
    check_ddp(NaiveDDP).ok. overlap=True (implied by bucket_size_mb) requires communication to start during
    backward; bucket_size_mb is passed to the constructor and checked against the messages sent."""
    name = getattr(wrapper_cls, "__name__", repr(wrapper_cls))
    cores = usable_cores()
    crowded = f"; {world_size} ranks on {cores} cores, oversubscribed" if world_size > cores else ""
    report = Report(f"{name} on {world_size} gloo ranks, {steps} steps{crowded}", implementation=wrapper_cls)
    kwargs = {} if bucket_size_mb is None else {"bucket_size_mb": bucket_size_mb}
    outcomes = run_checked(report, functools.partial(drive_ddp, wrapper_cls=wrapper_cls, kwargs=kwargs, steps=steps),
                           world_size=world_size, timeout=timeout, name=f"check-{name}", runs_root=runs_root)
    if outcomes is None:
        return report
    check_broadcast(report, outcomes)
    check_gradients(report, outcomes)
    check_traffic(report, outcomes)
    check_training(report, outcomes)
    check_overlap(report, outcomes, required=overlap or bucket_size_mb is not None)
    if bucket_size_mb is not None:
        check_buckets(report, outcomes, bucket_size_mb)
    return report


def check_broadcast(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """After construction every rank must hold rank 0's initial parameters, frozen ones included."""
    rank0_init = outcomes[0]["own_init"]
    frozen = {row["name"] for row in outcomes[0]["params"] if not row["requires_grad"]}
    for out in outcomes[1:]:
        differing = {name: (t - outcomes[0]["after_init"][name]).abs().max().item()
                     for name, t in out["after_init"].items() if not torch.equal(t, outcomes[0]["after_init"][name])}
        if not differing:
            continue
        worst = max(differing.values())
        if set(differing) <= frozen:
            report.add("broadcast", "fail", f"after construction rank {out['rank']}'s frozen "
                       f"{_names(differing)} (requires_grad=False) differs from rank 0's by up to {worst:.3g}: "
                       "broadcast every parameter, not only the trained ones")
        else:
            report.add("broadcast", "fail", f"after construction rank {out['rank']}'s weights differ from rank "
                       f"0's in {len(differing)} of {len(rank0_init)} tensors (by up to {worst:.3g}): broadcast "
                       "rank 0's parameters in the constructor")
        return
    moved = {name: (t - rank0_init[name]).abs().max().item() for name, t in outcomes[0]["after_init"].items()
             if not torch.equal(t, rank0_init[name])}
    if moved:
        report.add("broadcast", "fail", f"all ranks agree after construction, but not on rank 0's initial weights "
                   f"({len(moved)} tensors moved, by up to {max(moved.values()):.3g}): "
                   "send rank 0's values (broadcast from src=0), do not combine the ranks' values")
        return
    report.add("broadcast", "pass", f"after construction every rank holds rank 0's initial parameters, bitwise "
               f"({len(rank0_init)} tensors, the frozen one included)")


def check_gradients(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """After finish_gradient_synchronization() each rank's gradients must be the single-process gradients."""
    if report.status("broadcast") == "fail":
        report.add("gradients", "note", "not compared with one process: the ranks did not start from the same "
                   "parameters (see broadcast), so no single run matches them")
        return
    world = len(outcomes)
    problems: dict[int, dict[str, list[str]]] = {}  # step -> kind -> messages
    ratios, rel_diffs, compared = [], [], 0
    for out in outcomes:
        for step, record in enumerate(out["steps"]):
            found = problems.setdefault(step, {})
            for name, ref in record["expected"].items():
                grad, rank = record["grads"][name], out["rank"]
                if ref is None:
                    if grad is not None:
                        found.setdefault("frozen", []).append(
                            f"the frozen parameter {name} (requires_grad=False) has a gradient on rank {rank} after "
                            "finish_gradient_synchronization(): leave it without one")
                    continue
                compared += 1
                if grad is None:
                    found.setdefault("none", []).append(f"rank {rank} has no gradient for {name} after "
                                                        "finish_gradient_synchronization()")
                    continue
                ratio = (grad * ref).sum().item() / max((ref * ref).sum().item(), 1e-30)
                ratios.append(ratio)
                if _close(grad, ref):
                    rel_diffs.append(((grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
                elif _close(grad, ref * world):
                    found.setdefault("summed", []).append(
                        f"gradients are summed, not averaged: rank {rank}'s grad of {name} is {ratio:.3f}× the "
                        f"single-process grad (divide by the world size, {world})")
                elif _close(grad, record["local"][name]):
                    found.setdefault("local", []).append(
                        f"{name} was not averaged: rank {rank}'s gradient is still the gradient of its own rows; "
                        "every trained parameter's gradient must be all-reduced")
                else:
                    gap = (grad - ref).abs().max().item()
                    found.setdefault("other", []).append(
                        f"rank {rank}'s gradient of {name} is {ratio:.3f}× the single-process gradient (largest "
                        f"difference {gap:.3g})")
    report.measured["grad_ratio"] = float(torch.tensor(ratios).median()) if ratios else float("nan")
    wrong = [step for step in sorted(problems) if problems[step]]
    if wrong:  # later steps start from parameters the first wrong step already spoiled: report the first only
        first = problems[wrong[0]]
        for kind in ("summed", "local", "none", "other", "frozen"):
            if kind in first:
                more = len(first[kind]) - 1
                report.add("gradients", "fail", first[kind][0] + f" (step {wrong[0]}"
                           + (f"; {more} more like it)" if more else ")"))
        return
    report.measured["grad_rel_diff"] = max(rel_diffs)
    report.add("gradients", "pass", f"after finish_gradient_synchronization() every rank's gradients equal the "
               f"single-process gradients ({compared} tensor checks over ranks and steps; largest relative "
               f"difference {max(rel_diffs):.1e}, mean ratio {report.measured['grad_ratio']:.4f})")


def check_training(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """After each SGD step every rank's parameters must be the single-process run's."""
    worst, where = 0.0, ""
    for out in outcomes:
        for step, record in enumerate(out["steps"]):
            for name, value in record["params"].items():
                gap = (value - out["reference"][step][name]).abs().max().item()
                if gap > worst:
                    worst, where = gap, f"rank {out['rank']}, step {step}, {name}"
    steps = len(outcomes[0]["steps"])
    report.measured["param_diff"] = worst
    if worst > 1e-5:
        report.add("training", "fail", f"after SGD steps the parameters differ from the single-process run by up "
                   f"to {worst:.3g} ({where})")
    else:
        report.add("training", "pass", f"after {steps} SGD steps every rank's parameters match the single-process "
                   f"run to {worst:.1e}")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL * max(b.abs().max().item(), 1e-12))


def _names(items: dict[str, Any]) -> str:
    return ", ".join(sorted(items))
