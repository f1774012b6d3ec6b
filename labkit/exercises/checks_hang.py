"""Read a hang report, then fix the script: an early stop each rank decides alone (lesson 12).

    report = check_hang_report(HUNG_RANK, COLLECTIVE, failure)   # your reading of the report
    report = check_hang_fix(my_train_until)                      # your fix, on 2 gloo ranks
    my_train_until = report.use(train_until_fixed)               # yours if it passed

The planted script, `train_until(ctx, losses, threshold)`, stops early when `losses[rank, step]`
(this rank's loss) is below `threshold`: the rank whose loss dips first leaves the loop for the
barrier, while the others wait for it in the step's all-reduce. A reading names the rank to fix
(the one that never came to the collective the others wait in: the odd one out) and that
collective; both are taken from the failure the learner read, not from a table here.

A fix must finish, with the weights of the rule the exercise asks for: every rank stops at the
first step whose mean loss over the ranks is below `threshold`. The checker runs the learner's
function on 2 ranks, with losses chosen so that every other rule (some rank's loss, every rank's,
rank 0's, never stopping) stops at another step, and computes the reference in one process,
without collectives:

    runs      every rank finished (a hang names each rank's place in the learner's code and the
              call it waits in, within the timeout; a raise names the rank and the learner's line)
    agree     every rank returned the same weights (ranks that each decided alone disagree)
    weights   the reference's weights: a wrong stopping rule is named by the step it stopped at,
              a sum where the mean was meant by its factor
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .answers import check_name
from .learner import learner_part, run_checked
from .report import Finding, Report

LR = 0.1           # the planted script's learning rate: weights -= LR * (mean gradient)
WIDTH = 4          # the weights' length
TOLERANCE = 1e-5
# The checker's losses, [rank, step]. The mean over the ranks dips below 0.5 at step 3; rank 1's
# loss alone at step 2 (so "some rank's" stops there), rank 0's at 4, both at 5, the sum never:
# each rule stops at a step of its own, so a wrong rule is named by where it stopped.
CHECK_LOSSES = ((0.9, 0.8, 0.7, 0.6, 0.45, 0.3),
                (0.9, 0.7, 0.4, 0.3, 0.6, 0.3))
THRESHOLD = 0.5
HANG_HINT = ("An early stop decided on each rank's own loss lets one rank leave the loop while "
             "the others wait for it in the step's all_reduce: decide on a number every rank "
             "shares (all-reduce the loss first), so that every rank breaks at the same step.")


def train_until_fixed(ctx: Any, losses: torch.Tensor, threshold: float = THRESHOLD) -> torch.Tensor:
    """The reference fix: each rank all-reduces its loss first, so that every rank stops at the
    same step, the first whose mean loss over the ranks is below `threshold`; the weights."""
    weights = torch.zeros(WIDTH)
    for step in range(losses.shape[1]):
        ctx.heartbeat(step)
        loss = losses[ctx.rank, step].clone()
        dist.all_reduce(loss)                 # every rank decides on the same number
        if loss / ctx.world_size < threshold:
            break
        grad = losses[ctx.rank, step] * torch.ones(WIDTH)
        dist.all_reduce(grad)
        weights -= LR * grad / ctx.world_size
    dist.barrier()
    return weights


# -- part (a): the report read ---------------------------------------------------------------

def waiting_in(failure: Any) -> dict[int, str]:
    """Each rank of a hung run, and the collective its line says it waits in ("": its own code)."""
    out = {}
    for status in failure.statuses:
        ops = re.findall(r"in (\w+)\), called at", status.detail)
        out[status.rank] = ops[0] if ops else ""
    return out


def _as_rank(value: Any) -> Any:
    text = str(value).strip().lower().removeprefix("rank").strip()
    return int(text) if text.isdigit() else value


def _as_op(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    value = value.strip().removeprefix("torch.distributed.").removeprefix("dist.")
    return value.removesuffix("()")


def check_hang_report(rank: Any, collective: Any, failure: Any,
                      names: tuple[str, str] = ("HUNG_RANK", "COLLECTIVE")) -> Report:
    """Judge a reading of `failure`, the RankFailure of a hung run of 3 ranks or more: the rank
    that never came to the collective the others wait in, and that collective (`names`: the
    learner's names for the two):  check_hang_report(2, "all_reduce", failure).ok."""
    if failure is None:
        raise ValueError("the planted run finished: there is no hang report to read (run the "
                         "planted script as it ships)")
    places = waiting_in(failure)
    ops = [op for op in places.values() if op]
    common = max(set(ops), key=ops.count) if ops else ""
    odd = [r for r, op in places.items() if op != common]
    if len(odd) != 1 or ops.count(common) < 2:
        raise ValueError(f"this report has no single rank out of place ({places}): a reading "
                         "needs 3 ranks or more, one of them not where the others are")
    culprit, elsewhere = odd[0], places[odd[0]] or "its own code"
    waiters = sorted(r for r in places if r != culprit)
    wrong_rank = {r: f"rank {r} waits in {common}, as "
                     + " and ".join(f"rank {w}" for w in waiters if w != r)
                     + " does: it arrived, and waits for a rank that never came. The rank to fix "
                       "is the one alone in its place" for r in waiters}
    rank = _as_rank(rank)
    if isinstance(rank, int) and rank not in places:
        wrong_rank[rank] = f"there is no rank {rank} here: the ranks are 0..{len(places) - 1}"
    wrong_op = {elsewhere: f"{elsewhere} is where rank {culprit} waits now, after it went past "
                           "the collective it skipped: the collective it never made is the one "
                           "the other ranks wait in"}
    wrong_op.update({op: f"no rank waits in {op} in this report: read each rank's line, 'waiting "
                         "inside torch (... in <collective>)'"
                     for op in ("all_gather", "broadcast", "reduce_scatter", "send", "recv",
                                "reduce", "gather", "scatter", "barrier", "all_reduce")
                     if op not in places.values()})
    report = Report("your reading of the hang report", implementation=(rank, collective))
    answers = (check_name(rank, "the rank to fix", want=culprit, wrong=wrong_rank),
               check_name(_as_op(collective), "the collective it never made", want=common,
                          wrong=wrong_op))
    for check, name, answer in zip(("the rank", "the collective"), names, answers):
        for finding in answer.findings:
            report.findings.append(Finding(check, finding.status, finding.message,
                                           name if finding.status == "fail" else ""))
    report.measured.update({"culprit": culprit, "collective": common, "places": places})
    return report


# -- part (b): the fix, run ------------------------------------------------------------------

def reference_weights(losses: torch.Tensor, stop: int, summed: bool = False) -> torch.Tensor:
    """In one process, without collectives: the weights after `stop` steps of the mean gradient
    over the ranks (of their sum if `summed`)."""
    world = losses.shape[0]
    mean = losses[:, :stop].sum(dim=0) / (1 if summed else world)
    return -LR * mean.sum() * torch.ones(WIDTH)


def stops(losses: torch.Tensor, threshold: float) -> dict[str, int]:
    """The steps each stopping rule trains before it stops, the exercise's rule first."""
    steps = losses.shape[1]

    def first(below: torch.Tensor) -> int:
        return next((s for s in range(steps) if below[s]), steps)

    rules = {"the mean loss over the ranks": first(losses.mean(dim=0) < threshold),
             "some rank's loss": first((losses < threshold).any(dim=0)),
             "every rank's loss": first((losses < threshold).all(dim=0))}
    rules.update({f"rank {r}'s loss alone": first(losses[r] < threshold)
                  for r in range(losses.shape[0])})
    return rules


def _drive(ctx: Any, fn: Callable, losses: torch.Tensor, threshold: float,
           name: str) -> dict[str, Any]:
    with learner_part(ctx, name):
        weights = fn(ctx, losses.clone(), threshold)
    return {"weights": weights}


def check_hang_fix(fn: Callable, *, losses: Any = CHECK_LOSSES, threshold: float = THRESHOLD,
                   timeout: float = 8.0, runs_root: Any = None) -> Report:
    """Run `fn(ctx, losses, threshold)` on one gloo rank per row of `losses` (2) and judge the
    weights each returns; a hang is reported after `timeout` s without progress (a heartbeat):
    check_hang_fix(my_train_until).ok."""
    name = getattr(fn, "__name__", "your fix")
    losses = torch.as_tensor(losses, dtype=torch.float32)
    world = losses.shape[0]
    report = Report(f"{name}: an early stop every rank agrees on, on {world} gloo ranks",
                    implementation=fn)
    drive = functools.partial(_drive, fn=fn, losses=losses, threshold=threshold, name=name)
    outcomes = run_checked(report, drive, world_size=world, timeout=timeout, name=f"check-{name}",
                           runs_root=runs_root, hang_hint=HANG_HINT)
    if outcomes is None:
        return report
    report.add("runs", "pass", "every rank finished: no hang")
    got = [out["weights"] for out in outcomes]
    if not all(isinstance(w, torch.Tensor) and w.shape == (WIDTH,) for w in got):
        report.add("weights", "fail", f"{name} returned {[type(w).__name__ for w in got]}: "
                                      f"return the weights, a tensor of {WIDTH}", part=name)
        return report
    rules = stops(losses, threshold)
    if not all(torch.allclose(w, got[0], atol=TOLERANCE) for w in got):
        said = "; ".join(f"rank {r} {_stopped_at(w, losses, rules)}" for r, w in enumerate(got))
        report.add("agree", "fail", f"the ranks ended with different weights ({said}): each rank "
                                    "decided on its own when to stop; decide on a number every "
                                    "rank shares", part=name)
        return report
    report.add("agree", "pass", "every rank ended with the same weights")
    rule, stop = next(iter(rules.items()))
    report.measured.update({"stopped": _stopped_at(got[0], losses, rules), "want_steps": stop})
    if torch.allclose(got[0], reference_weights(losses, stop), atol=TOLERANCE):
        report.add("weights", "pass", f"stopped after {stop} steps, when {rule} fell below "
                                      f"{threshold}, as one process computes it")
        return report
    report.add("weights", "fail", f"{_stopped_at(got[0], losses, rules)}; the exercise stops after "
                                  f"{stop} steps, the first whose mean loss over the ranks is "
                                  f"below {threshold} (all-reduce the loss, divide by the world "
                                  "size)", part=name)
    return report


def _stopped_at(weights: torch.Tensor, losses: torch.Tensor, rules: dict[str, int]) -> str:
    """A result in words: the step it stopped at and the rules that stop there; a sum for a mean."""
    steps, world = losses.shape[1], losses.shape[0]
    for summed in (False, True):
        for stop in range(steps + 1):
            if not torch.allclose(weights, reference_weights(losses, stop, summed),
                                  atol=TOLERANCE):
                continue
            why = " or ".join(rule for rule, at in rules.items() if at == stop)
            if stop == steps:
                text = (f"trained all {steps} steps: it never stopped (the early stop is gone, or "
                        "it compares the summed loss: divide it by the world size)")
            elif why:
                text = f"stopped after {stop} steps, when {why} fell below the threshold"
            else:
                text = f"stopped after {stop} steps, where no loss below the threshold stops it"
            summed_text = f", and the gradients are summed, not averaged ({world}x)"
            return text + (summed_text if summed else "")
    return f"weights {weights[0].item():.4f}, which no number of steps of the mean gradient gives"
