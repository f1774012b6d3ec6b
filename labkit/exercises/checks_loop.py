"""Write the core of data-parallel training yourself, checked on 2 gloo ranks against one process
trained on the same samples: the DDP loop (lesson 00) and accumulation under no_sync (lesson 04).

    def train_ddp(ctx, model, optimizer, batches):   # 00: one step per global batch (x, y)
        ...                               # DDP, this rank's share, zero_grad, mean loss, step
    report = check_ddp_loop(train_ddp)
    train_ddp = report.use(ddp_train)              # yours if it passed

    def accumulation_step(ddp_model, micro_batches, optimizer):   # 04: one step, one all-reduce
        ...
    report = check_accumulation(accumulation_step)
    accumulation_step = report.use(accumulate_with_no_sync)

Inside each rank (loop_rank.py) the checker watches the learner's code without changing what it
does: the rows each forward gets, every all-reduce DDP launches and the backward it follows (a comm
hook on every DDP built in the rank, the learner's own included), and the weights after each
optimizer step. The reference is one process, no DDP: SGD on each step's whole batch, mean loss.

    runs        every rank finished (a raise names the rank and the learner's line; a hang, each
                rank's place)
    steps       one optimizer step per global batch (04: per call, not per micro-batch)
    all-reduce  00: every step all-reduced (none: the model is not wrapped, or the wrapper not
                called), the ranks' weights bitwise equal; 04: one backward of the k all-reduced per
                step, the last (k: no no_sync; 0: no_sync on the last too: the ranks drift, how far)
    samples     00: the ranks' rows of each batch are disjoint, equal in number, and cover it
    weights     each step's weights are one process's within 1e-5; a wrong first step is read as
                its ratio to one process's (the loss summed, not divided by k, scaled by the world
                size), a later first difference tested against gradients never zeroed
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .learner import run_checked
from .loop_rank import (ACCUM_STEPS, LOOP_BATCH, LOOP_STEPS, MICRO, MICRO_SIZE, WORLD,
                        accumulate_with_no_sync, ddp_train, drive_accum, drive_loop,
                        global_batches, make_model, one_process)
from .report import Report

__all__ = ["check_ddp_loop", "check_accumulation", "ddp_train", "accumulate_with_no_sync"]
TOLERANCE = 1e-5


def check_ddp_loop(fn: Callable, *, timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Run `fn(ctx, model, optimizer, batches)` on 2 gloo ranks:  check_ddp_loop(train_ddp).ok."""
    name = getattr(fn, "__name__", "your loop")
    report = Report(f"{name}: the DDP loop on {WORLD} gloo ranks, against one process on each "
                    "whole batch", implementation=fn)
    outcomes = run_checked(report, functools.partial(drive_loop, fn=fn, name=name),
                           world_size=WORLD, timeout=timeout, name=f"check-{name}",
                           runs_root=runs_root,
                           hang_hint="DDP all-reduces in every backward of the wrapped model: "
                                     "every rank must run the same steps; a rank that trains on a "
                                     "batch the others skip waits in its extra backward forever.")
    if outcomes is None:
        return report
    steps = len(outcomes[0]["after"])
    if steps != LOOP_STEPS:
        report.add("steps", "fail", f"the optimizer stepped {steps} times for {LOOP_STEPS} global "
                                    "batches: step once per batch, after its backward", part=name)
        return report
    report.add("steps", "pass", f"one optimizer step per global batch ({LOOP_STEPS})")
    batches, share = global_batches(LOOP_STEPS, LOOP_BATCH), LOOP_BATCH // WORLD
    if _loop_synced(report, outcomes, name) and _samples(report, outcomes, batches, name):
        _weights(report, outcomes[0]["after"], batches, name, {
            float(share): f"the loss is summed over the rank's {share} samples, not averaged: use "
                          "the mean (F.mse_loss's default reduction)",
            float(WORLD): f"the loss or the gradients were multiplied by the world size ({WORLD})",
            1 / WORLD: f"the loss was divided by the world size ({WORLD}): DDP already averages "
                       "the gradients over the ranks"})
    return report


def _loop_synced(report: Report, outcomes: list[dict], name: str) -> bool:
    gap = _gap(outcomes[0]["after"][-1], outcomes[1]["after"][-1])
    rows = outcomes[0]["rows"]
    # an all-reduce follows the backward of the latest forward: that forward's step is its step
    steps = [rows[f - 1][0] if 0 < f <= len(rows) else -1 for _, f in outcomes[0]["reduced"]]
    per_step = [steps.count(s) for s in range(LOOP_STEPS)]
    report.measured.update(rank_gap=gap, allreduces_per_step=per_step)
    apart = (f" (after {LOOP_STEPS} steps rank 0's and rank 1's weights are {gap:.1e} apart: each "
             "rank stepped on its own samples' gradient alone)") if gap else ""
    if outcomes[0]["ddps"] == 0:
        said = ("the model is not wrapped in DDP: no all-reduce ran" + apart + ". Wrap it, "
                "ddp_model = DDP(model), and compute the loss with ddp_model(x)")
    elif 0 in per_step:
        said = (f"DDP wrapped the model, but {per_step.count(0)} of {LOOP_STEPS} steps made no "
                "all-reduce: their loss came from the model inside the wrapper; call the wrapper, "
                "ddp_model(x), not model(x)" + apart)
    elif gap:
        said = (f"every step all-reduced, yet rank 0's and rank 1's weights end {gap:.1e} apart: "
                "something the ranks do after the all-reduce differs")
    else:
        report.add("all-reduce", "pass", f"every step all-reduced the gradients ({max(per_step)} "
                                         "all-reduce(s), DDP's buckets); the ranks' weights are "
                                         "bitwise equal")
        return True
    report.add("all-reduce", "fail", said, part=name)
    return False


def _samples(report: Report, outcomes: list[dict], batches: list, name: str) -> bool:
    for step, (x, _) in enumerate(batches):
        index = {tuple(row.tolist()): i for i, row in enumerate(x)}
        held = []
        for rank, out in enumerate(outcomes):
            ids = [index.get(tuple(row.tolist())) for s, rows in out["rows"] if s == step
                   for row in rows]
            if None in ids:
                report.add("samples", "fail", f"rank {rank} fed the model rows that are not in "
                                              f"step {step}'s global batch: train on the batches "
                                              "you were given", part=name)
                return False
            held.append(ids)
        share, seen = len(x) // WORLD, [set(ids) for ids in held]
        if all(ids == seen[0] for ids in seen):
            what = (f"the whole global batch ({len(x)} samples) instead of its share of {share}: "
                    "each rank computed the same gradient" if len(seen[0]) == len(x) else
                    f"the same samples ({_rows(seen[0])} of each global batch of {len(x)}) "
                    f"instead of its own share: the ranks trained on {len(seen[0])} of the "
                    f"{len(x)} samples")
            report.add("samples", "fail", f"every rank read {what}; take "
                                          "x.chunk(ctx.world_size)[ctx.rank]", part=name)
            return False
        counted, union = [len(ids) for ids in held], set().union(*seen)
        if counted != [share] * WORLD or len(union) != len(x):
            report.add("samples", "fail", f"at step {step} the ranks read {counted} samples, "
                                          f"{sum(counted) - len(union)} read twice and "
                                          f"{len(x) - len(union)} by no rank: give each rank an "
                                          "equal share, x.chunk(ctx.world_size)[ctx.rank]",
                       part=name)
            return False
    report.add("samples", "pass", f"each rank read its own {LOOP_BATCH // WORLD} samples of each "
                                  "global batch, together all of it")
    return True


def _rows(ids: set) -> str:
    low, high = min(ids), max(ids)
    return f"rows {low}-{high}" if len(ids) == high - low + 1 else f"{len(ids)} rows"


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _weights(report: Report, got: list, batches: list, name: str,
             factors: dict[float, str]) -> bool:
    """Each step's weights against one process's; a wrong first step named by its ratio to one
    process's, a later one tested against gradients that were never zeroed."""
    want = one_process(batches)
    gaps = [_gap(g, w) for g, w in zip(got, want)]
    report.measured["weight_gap"] = max(gaps)
    wrong = next((step for step, gap in enumerate(gaps) if gap > TOLERANCE), None)
    if wrong is None:
        report.add("weights", "pass", f"after each of {len(got)} steps the weights are one "
                                      "process's on the whole batch within "
                                      f"{TOLERANCE:.0e} (max gap {max(gaps):.1e})")
        return True
    if wrong == 0:
        ratio = _ratio(got[0], want[0], [p.detach() for p in make_model().parameters()])
        report.measured["step_ratio"] = ratio
        if ratio == 0.0:
            said = ("the first step moved no weight: the gradients were zeroed between backward() "
                    "and step(), or the optimizer stepped before any backward")
        elif ratio is None:
            said = (f"the first step's weights are {gaps[0]:.1e} from one process's and no "
                    "multiple of its update: the gradient is of other samples or another loss "
                    "(mean squared error)")
        else:
            said = next((f"the step is {ratio:.3f}× one process's on the whole batch: {why}"
                         for k, why in factors.items() if abs(ratio - k) < 1e-3 * k),
                        f"the step is {ratio:.3f}× one process's on the whole batch: the loss "
                        "is scaled")
    elif all(_gap(g, k) <= TOLERANCE for g, k in zip(got, one_process(batches, keep_grads=True))):
        said = (f"the gradients accumulate across optimizer steps: step {wrong + 1} stepped with "
                "the earlier steps' gradients added, as no optimizer.zero_grad() ran; zero them "
                "before each step's backward")
    else:
        said = (f"the weights are one process's up to step {wrong}, then {gaps[wrong]:.1e} away "
                f"after step {wrong + 1}")
    report.add("weights", "fail", said, part=name)
    return False


def _ratio(got: list, want: list, start: list) -> float | None:
    """The k with got - start = k (want - start); 0.0 if nothing moved; None if no k fits."""
    moved = torch.cat([(g - s).flatten() for g, s in zip(got, start)])
    ref = torch.cat([(w - s).flatten() for w, s in zip(want, start)])
    if moved.abs().max().item() == 0.0:
        return 0.0
    k = float(moved @ ref / (ref @ ref))
    return k if (moved - k * ref).norm() <= 1e-3 * moved.norm() + 1e-7 else None


def check_accumulation(fn: Callable, *, timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Run `fn(ddp_model, micro_batches, optimizer)`, once per optimizer step, on 2 gloo ranks:
    check_accumulation(accumulation_step).ok."""
    name = getattr(fn, "__name__", "your step")
    report = Report(f"{name}: {MICRO} micro-batches per optimizer step on {WORLD} gloo ranks, "
                    "against one process on the whole batch", implementation=fn)
    outcomes = run_checked(report, functools.partial(drive_accum, fn=fn, name=name),
                           world_size=WORLD, timeout=timeout, name=f"check-{name}",
                           runs_root=runs_root,
                           hang_hint="Every rank must make the same all-reduces: a backward "
                                     "outside no_sync() on one rank and inside it on another "
                                     "leaves the first waiting. Choose no_sync() by the "
                                     "micro-batch's index, the same on every rank.")
    if outcomes is None:
        return report
    per_call = [outcomes[0]["stepped"].count(c) for c in range(ACCUM_STEPS)]
    if per_call != [1] * ACCUM_STEPS:
        said = (f"the optimizer stepped at every micro-batch: {MICRO} steps in one call, want 1; "
                "step once, after the last micro-batch's backward" if per_call[0] == MICRO else
                f"the optimizer stepped {per_call} times in the {ACCUM_STEPS} calls, want once "
                "per call")
        report.add("steps", "fail", said, part=name)
        return report
    report.add("steps", "pass", f"one optimizer step per call, after its {MICRO} micro-batches")
    if _accum_synced(report, outcomes, name):
        _weights(report, outcomes[0]["after"],
                 global_batches(ACCUM_STEPS, WORLD * MICRO * MICRO_SIZE), name, {
            float(MICRO): f"the loss is not divided by the number of micro-batches ({MICRO}); "
                          "divide each micro-batch's loss by len(micro_batches)",
            float(MICRO * MICRO_SIZE): f"each micro-batch's loss is summed over its {MICRO_SIZE} "
                                       f"samples and not divided by the {MICRO} micro-batches: "
                                       "take the mean, divide by len(micro_batches)",
            float(MICRO_SIZE): f"each micro-batch's loss is summed over its {MICRO_SIZE} samples, "
                               "not averaged",
            1 / MICRO: f"the loss was divided by the number of micro-batches ({MICRO}) twice",
            float(WORLD): f"the loss or the gradients were multiplied by the world size ({WORLD})",
            1 / WORLD: f"the loss was divided by the world size ({WORLD}): DDP already averages "
                       "the gradients over the ranks"})
    return report


def _accum_synced(report: Report, outcomes: list[dict], name: str) -> bool:
    reduced = outcomes[0]["reduced"]
    # the backward passes that all-reduced, by the forward they followed (DDP may send several
    # buckets from one backward)
    backwards = [sorted({f for c, f in reduced if c == call}) for call in range(ACCUM_STEPS)]
    counts = [len(b) for b in backwards]
    gap = _gap(outcomes[0]["after"][0], outcomes[1]["after"][0])
    report.measured.update(allreduced_backwards_per_step=counts, rank_gap=gap,
                           allreduces_per_step=[[c for c, _ in reduced].count(call)
                                                for call in range(ACCUM_STEPS)])
    if counts[0] == MICRO:
        said = (f"the all-reduce ran at every micro-batch: {MICRO} backward passes all-reduced "
                "in 1 optimizer step, want 1; run all but the last micro-batch under "
                "ddp_model.no_sync()")
    elif counts[0] == 0:
        said = ("no backward all-reduced: no_sync() covered every micro-batch, the last one too, "
                "so each rank stepped on its own gradient and after step 1 the ranks' weights are "
                f"{gap:.1e} apart; leave the last micro-batch outside no_sync()")
    elif counts != [1] * ACCUM_STEPS:
        said = (f"{counts} backward passes all-reduced in the {ACCUM_STEPS} optimizer steps, "
                "want 1 per step (the last micro-batch's); run all but the last under "
                "ddp_model.no_sync()")
    elif [b[0] for b in backwards] != [(call + 1) * MICRO for call in range(ACCUM_STEPS)]:
        said = (f"the all-reduce ran after micro-batch {backwards[0][0]} of {MICRO}, not the last: "
                "the later micro-batches' gradients were added after it, on each rank alone; keep "
                "no_sync() on all but the last" + (f" (the ranks' weights are {gap:.1e} apart)"
                                                   if gap else ""))
    elif gap:
        said = (f"one all-reduce per step, yet rank 0's and rank 1's weights are {gap:.1e} apart "
                "after step 1")
    else:
        report.add("all-reduce", "pass", f"one backward of the {MICRO} all-reduced per optimizer "
                                         "step, the last "
                                         f"({max(report.measured['allreduces_per_step'])} "
                                         "all-reduce(s), DDP's buckets); the ranks' weights are "
                                         "bitwise equal")
        return True
    report.add("all-reduce", "fail", said, part=name)
    return False
