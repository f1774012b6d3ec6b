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
from .traffic import check_buckets, check_overlap, check_traffic, sync_events

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
    check_hooks(report, outcomes)
    check_waited(report, outcomes)
    check_gradients(report, outcomes, hooked=overlap or bucket_size_mb is not None)
    check_traffic(report, outcomes)
    check_training(report, outcomes)
    check_overlap(report, outcomes, required=overlap or bucket_size_mb is not None)
    if bucket_size_mb is not None:
        check_buckets(report, outcomes, bucket_size_mb)
    return report


def init_part(outcomes: list[dict[str, Any]]) -> str:
    return f"{outcomes[0]['class']}.__init__"


def finish_part(outcomes: list[dict[str, Any]]) -> str:
    return f"{outcomes[0]['class']}.finish_gradient_synchronization"


def check_broadcast(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """After construction every rank must hold rank 0's initial parameters, frozen ones included."""
    rank0_init = outcomes[0]["own_init"]
    frozen = {row["name"] for row in outcomes[0]["params"] if not row["requires_grad"]}
    part = init_part(outcomes)
    for out in outcomes[1:]:
        differing = {name: (t - outcomes[0]["after_init"][name]).abs().max().item()
                     for name, t in out["after_init"].items() if not torch.equal(t, outcomes[0]["after_init"][name])}
        if not differing:
            continue
        worst = max(differing.values())
        if set(differing) <= frozen:
            report.add("broadcast", "fail", f"after construction rank {out['rank']}'s frozen "
                       f"{_names(differing)} (requires_grad=False) differs from rank 0's by up to {worst:.3g}: "
                       "broadcast every parameter, not only the trained ones", part=part)
        else:
            report.add("broadcast", "fail", f"after construction rank {out['rank']}'s weights differ from rank "
                       f"0's in {len(differing)} of {len(rank0_init)} tensors (by up to {worst:.3g}): broadcast "
                       "rank 0's parameters in the constructor", part=part)
        return
    moved = {name: (t - rank0_init[name]).abs().max().item() for name, t in outcomes[0]["after_init"].items()
             if not torch.equal(t, rank0_init[name])}
    if moved:
        others = [o["rank"] for o in outcomes[1:] if all(torch.equal(t, o["own_init"][n])
                                                         for n, t in outcomes[0]["after_init"].items())]
        source = f"rank {others[0]}'s initial weights (broadcast from src={others[0]}?)" if others else \
            "no rank's initial weights (the ranks' values were combined?)"
        report.add("broadcast", "fail", f"all ranks agree after construction, but not on rank 0's initial weights "
                   f"({len(moved)} tensors moved, by up to {max(moved.values()):.3g}); they hold {source}: "
                   "send rank 0's values (broadcast from src=0)", part=part)
        return
    report.add("broadcast", "pass", f"after construction every rank holds rank 0's initial parameters, bitwise "
               f"({len(rank0_init)} tensors, the frozen one included)")


def check_hooks(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """A gradient hook registered twice on one parameter runs twice per backward."""
    for name, hook, times in outcomes[0].get("hooked_twice", [])[:1]:
        report.add("hooks", "fail", f"{hook} was registered {times} times as a gradient hook on {name}, so it runs "
                   f"{times} times per backward: register one hook per parameter", part=init_part(outcomes))


def check_waited(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """Every async collective of a step must have been waited for when finish_gradient_synchronization() returns:
    checked from the calls made (wait() on the handle, or its future taken), not from timing."""
    for out in outcomes:
        for step, record in enumerate(out["steps"]):
            if record.get("unwaited"):
                started = sorted(set(filter(None, record["unwaited"])))
                report.add("waited", "fail", f"{len(record['unwaited'])} async collectives"
                           + (f" (started in your {', '.join(started)})" if started else "")
                           + f" were never waited for when finish_gradient_synchronization() returned (rank "
                           f"{out['rank']}, step {step}; {record['unfinished']} of them still running then): call "
                           "wait() on every handle before the optimizer reads the gradients",
                           part=finish_part(outcomes))
                return


def gradient_part(outcomes: list[dict[str, Any]], step: int, kind: str, hooked: bool) -> str:
    """The learner's function to blame for a gradient of kind `kind` at `step`: for a wrong scale, the function
    that made the step's collectives (the division belongs beside them); for a gradient no collective carried,
    the constructor (that registers hooks and plans buckets) where the exercise sends from hooks, else the
    function that sends the others; for values copied back wrong, finish_gradient_synchronization."""
    events = sync_events(outcomes[0], step)
    callers = [e.get("caller", "") for e in events if e.get("caller")]
    callers += [e["caller"] for e in outcomes[0].get("p2p", []) if e["step"] == step and e.get("caller")]
    made = max(set(callers), key=callers.count) if callers else ""
    hooks = outcomes[0].get("hooks", [])
    trained = sum(r["bytes"] for r in outcomes[0]["params"] if r["requires_grad"])
    if kind in ("summed", "twice", "scaled", "max", "one rank"):
        return made or (hooks[0] if hooks else finish_part(outcomes))
    if kind in ("local", "unsent"):
        if events and sum(e["bytes"] for e in events) >= trained:
            return finish_part(outcomes)   # every gradient's bytes were sent: the copy back did not happen
        if hooked:
            return init_part(outcomes) if not hooks or callers else hooks[0]
        return made or finish_part(outcomes)
    return finish_part(outcomes)


def diagnose(grad: torch.Tensor, ref: torch.Tensor, locals_: list[torch.Tensor], rank: int, world: int,
             name: str, order: list[torch.Tensor]) -> tuple[str, str]:
    """(kind, sentence) for a wrong gradient: which simple combination of the ranks' own gradients it is."""
    ratio = (grad * ref).sum().item() / max((ref * ref).sum().item(), 1e-30)
    head = f"rank {rank}'s gradient of {name} is {ratio:.3f}× the single-process gradient"
    stacked = torch.stack(locals_)
    if _close(grad, ref * world):
        return "summed", (f"gradients are summed, not averaged: rank {rank}'s grad of {name} is {ratio:.3f}× the "
                          f"single-process grad (divide by the world size, {world})")
    if _close(grad, ref / world):
        return "twice", (f"{head}: 1/{world} of the average, which was divided by the world size ({world}) once "
                         "more than needed (sum over the ranks, then divide once)")
    if _close(grad, locals_[rank]):
        return "local", (f"{name} was not averaged: rank {rank}'s gradient is still the gradient of its own rows; "
                         "every trained parameter's gradient must be all-reduced")
    if _close(grad, locals_[rank] / world):
        return "unsent", (f"{head}: its own rows' gradient divided by the world size ({world}), never summed over "
                          "the ranks: no collective carried it")
    for other in range(world):
        if other != rank and (_close(grad, locals_[other]) or _close(grad, locals_[other] / world)):
            divided = "" if _close(grad, locals_[other]) else f" / {world}"
            return "one rank", (f"{head}: it is rank {other}'s own gradient{divided}, not the average over all "
                                "ranks (a value sent from one rank, not summed)")
    for op, value in (("maximum", stacked.max(0).values), ("minimum", stacked.min(0).values)):
        if _close(grad, value) or _close(grad, value / world):
            return "max", (f"{head}: the element-wise {op} over the ranks, not their sum (ReduceOp.SUM, the "
                           "default, then divide by the world size)")
    if ref.abs().max() > 0 and _close(grad, ref * ratio):
        return "scaled", (f"{head} in every element: a scale mistake (sum over the {world} ranks, then divide by "
                          f"{world} exactly once)")
    if grad.abs().max() == 0:
        return "copy", f"{head}: it is all zeros, as if the averaged values were never copied into it"
    shift = _shifted(grad, ref, order)
    if shift is not None:
        return "copy", (f"{head}: it holds averaged gradient values, but {abs(shift)} elements "
                        f"{'later' if shift > 0 else 'earlier'} in the gradients laid end to end than its own: an "
                        "offset into a flat buffer is off")
    right = _elementwise_close(grad, ref).float().mean().item()
    return "other", (f"{head} (largest difference {(grad - ref).abs().max().item():.3g}); {right:.0%} of its "
                     f"elements are right. It is none of: the average, the sum, the rank's own gradient, another "
                     "rank's, their maximum, or the average copied from a shifted place")


def _shifted(grad: torch.Tensor, ref: torch.Tensor, order: list[torch.Tensor]) -> int | None:
    """If `grad` is a window of the reference gradients laid end to end (in `order`) other than its own: the
    offset from its own place, else None."""
    flat = torch.cat([t.reshape(-1) for t in order])
    n = grad.numel()
    if n > flat.numel():
        return None
    own = next((i for i in range(flat.numel() - n + 1) if torch.equal(flat[i:i + n], ref.reshape(-1))), None)
    windows = flat.unfold(0, n, 1)
    scale = max(ref.abs().max().item(), 1e-12)
    close = ((windows - grad.reshape(-1)).abs() <= RTOL * windows.abs() + ATOL * scale).all(1).nonzero()
    found = [int(i) for i in close.flatten() if own is None or int(i) != own]
    return (found[0] - own) if found and own is not None else None


def check_gradients(report: Report, outcomes: list[dict[str, Any]], hooked: bool = False) -> None:
    """After finish_gradient_synchronization() each rank's gradients must be the single-process gradients."""
    if report.status("waited") == "fail":
        report.add("gradients", "note", "not compared with one process: async collectives were not waited for "
                   "(see waited), so what the gradients hold then depends on timing")
        return
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
            trained = [n for n, r in record["expected"].items() if r is not None]
            order = [record["expected"][n] for n in trained][::-1]   # backward's order, as buckets fill
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
                    continue
                locals_ = [o["steps"][step]["local"][name] for o in outcomes]
                kind, said = diagnose(grad, ref, locals_, rank, world, name, order)
                found.setdefault(kind, []).append(said)
    report.measured["grad_ratio"] = float(torch.tensor(ratios).median()) if ratios else float("nan")
    wrong = [step for step in sorted(problems) if problems[step]]
    if wrong:  # later steps start from parameters the first wrong step already spoiled: report the first only
        first = problems[wrong[0]]
        for kind in ("summed", "twice", "local", "unsent", "one rank", "max", "scaled", "copy", "none", "other",
                     "frozen"):
            if kind in first:
                more = len(first[kind]) - 1
                report.add("gradients", "fail", first[kind][0] + f" (step {wrong[0]}"
                           + (f"; {more} more like it)" if more else ")"),
                           part=gradient_part(outcomes, wrong[0], kind, hooked))
        return
    report.measured["grad_rel_diff"] = max(rel_diffs)
    report.add("gradients", "pass", f"after finish_gradient_synchronization() every rank's gradients equal the "
               f"single-process gradients ({compared} tensor checks over ranks and steps; largest relative "
               f"difference {max(rel_diffs):.1e}, mean ratio {report.measured['grad_ratio']:.4f})")


def check_training(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """After each SGD step every rank's parameters must be the single-process run's."""
    if report.status("waited") == "fail":
        return
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
                   f"to {worst:.3g} ({where})", part=finish_part(outcomes))
    else:
        report.add("training", "pass", f"after {steps} SGD steps every rank's parameters match the single-process "
                   f"run to {worst:.1e}")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL * max(b.abs().max().item(), 1e-12))


def _elementwise_close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.isclose(a, b, rtol=RTOL, atol=ATOL * max(b.abs().max().item(), 1e-12))


def _names(items: dict[str, Any]) -> str:
    return ", ".join(sorted(items))
