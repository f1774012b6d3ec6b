"""One verdict on a non-finite loss, the same on every rank (lesson 09), on 2 and 3 gloo ranks.

    def all_finite(loss) -> bool:          # True on every rank when every rank's loss is finite
        ...
    report = check_all_finite(all_finite)  # a NaN or an inf planted on one rank, then on others
    all_finite = report.use(reference_all_finite)

The checker runs a training loop whose step holds a gradient all-reduce (as DDP's), with a NaN or
an inf added to the loss of chosen ranks at chosen steps: one rank, then another, then every rank.
After the learner's call it gathers the ranks' verdicts on a process group of its own, so that it
never pairs with the learner's collectives. Ranks that disagree are named at the first such step,
and the loop ends there; a real loop would hang in the next gradient all-reduce instead.

    runs    every rank finished (a collective only some ranks call, e.g. only the rank that saw
            the NaN, is a hang: each rank's place is named)
    agree   every rank returned the same verdict at every step
    skips   exactly the planted steps were skipped (one rank's NaN outvoted, an inf missed, one
            step late)
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .learner import learner_part, run_checked
from .report import Report

def reference_all_finite(loss: torch.Tensor) -> bool:
    """True on every rank when every rank's loss is finite: each rank sets its slot of a flag,
    and one all-reduce shows every rank every verdict."""
    flag = torch.zeros(dist.get_world_size())
    flag[dist.get_rank()] = float(
        not math.isfinite(loss.item())
    )  # 1: this rank's loss is NaN or inf
    dist.all_reduce(flag)  # the sum: every rank's slot, on every rank
    return not bool(flag.any())


def planted(world: int) -> dict[int, dict[int, float]]:
    """step -> {rank: what is added to its loss}: one rank's NaN, another rank's inf, then every
    rank's NaN (on 3 ranks also two of three): one bad rank must be enough, an inf must count."""
    nan, inf = math.nan, math.inf
    if world == 2:
        return {3: {1: nan}, 6: {0: inf}, 8: {0: nan, 1: nan}}
    return {
        2: {world - 1: nan},
        4: {1: nan, 2: inf},
        6: {0: inf},
        8: {r: nan for r in range(world)},
    }


def _drive_flag(ctx: Any, fn: Callable, steps: int, name: str) -> dict[str, Any]:
    audit = (
        dist.new_group()
    )  # the checker's own group: its all_gather never pairs with the learner's collectives
    plan = planted(ctx.world_size)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + ctx.rank)
    verdicts: list[list[bool]] = []
    for step in range(steps):
        ctx.heartbeat(step)
        x = torch.randn(8, 4, generator=data)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True)) + plan.get(step, {}).get(ctx.rank, 0.0)
        with learner_part(ctx, name, step):
            ok = bool(fn(loss))
        everyone = [torch.zeros(1) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, torch.tensor([float(ok)]), group=audit)
        verdicts.append([bool(v.item()) for v in everyone])
        if len(set(verdicts[-1])) > 1:
            break  # a real loop: the ranks that go on would wait in the gradient all-reduce below
        if not ok:
            continue
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # a collective inside the step, as DDP's
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        opt.step()
    dist.barrier(group=audit)
    return {"verdicts": verdicts, "weights": [p.detach().clone() for p in model.parameters()]}


def check_all_finite(
    fn: Callable,
    *,
    worlds: tuple[int, ...] = (2, 3),
    steps: int = 10,
    timeout: float = 15.0,
    runs_root: Any = None,
) -> Report:
    """Run `fn(loss) -> bool` at every step, NaNs and infs planted on some ranks:
    check_all_finite(fn).ok."""
    name = getattr(fn, "__name__", "your flag")
    report = Report(
        f"{name}: one verdict on a non-finite loss, on {' and '.join(map(str, worlds))} gloo ranks",
        implementation=fn,
    )
    for world in worlds:
        outcomes = run_checked(
            report,
            functools.partial(_drive_flag, fn=fn, steps=steps, name=name),
            world_size=world,
            timeout=timeout,
            name=f"check-{name}-{world}",
            runs_root=runs_root,
            hang_hint="Every rank must call the flag's all-reduce at every step, whatever its "
            "own loss: a collective inside `if not finite:` runs on one rank only.",
        )
        if outcomes is None or not _judge_flag(
            report, [o["verdicts"] for o in outcomes], world, steps, name
        ):
            return report
    return report


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _said(value: float) -> str:
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def _judge_flag(
    report: Report, verdicts: list[list[list[bool]]], world: int, steps: int, name: str
) -> bool:
    plan = planted(world)
    want = sorted(plan)

    def fail(check: str, message: str) -> bool:
        report.add(check, "fail", f"{world} ranks: {message}", part=name)
        return False

    for step, row in enumerate(verdicts[0]):
        if len(set(row)) > 1:
            skipped = [r for r, ok in enumerate(row) if not ok]
            went = [r for r, ok in enumerate(row) if ok]
            bad = ", ".join(
                f"rank {r}'s loss was {_said(v)}" for r, v in plan.get(step, {}).items()
            )
            return fail(
                "agree",
                f"the ranks disagree at step {step}: {_ranks(skipped)} skipped it, "
                f"{_ranks(went)} did not ({bad or 'every loss was finite'}). Each rank judged only "
                f"its own loss: all-reduce a flag (MAX of 'bad', or MIN of 'ok') so that "
                f"every rank sees every verdict. In a real loop rank {went[0]} would go on "
                f"into step {step}'s gradient all-reduce, which rank {skipped[0]} never "
                "joins: a hang",
            )
    report.add(
        "agree", "pass", f"{world} ranks: every rank returned the same verdict at every step"
    )
    done = [s for s, row in enumerate(verdicts[0]) if not row[0]]
    if done == want:
        report.add(
            "skips",
            "pass",
            f"{world} ranks: every rank skipped steps {want}, where some rank's loss was "
            "NaN or inf, and only those",
        )
        return True
    if done == [s + 1 for s in want if s + 1 < steps]:
        return fail(
            "skips",
            f"skipped steps {done}, one step after the non-finite losses at {want}: judge "
            "this step's loss, before this step's update",
        )
    if done == [s for s in range(steps) if s not in want]:
        return fail("skips", f"skipped every step but {want}, where some rank's loss was NaN or "
                             f"inf: {name}'s answer is inverted (True means every loss is finite)")
    missed = [s for s in want if s not in done]
    extra = [s for s in done if s not in want]
    if (
        not extra
        and missed
        and all(not any(math.isnan(v) for v in plan[s].values()) for s in missed)
    ):
        return fail(
            "skips",
            f"no rank skipped step(s) {missed}, where a loss was inf, not NaN: check "
            "math.isfinite (or torch.isfinite), not only isnan",
        )
    if not extra and missed and all(len(plan[s]) < world for s in missed):
        every = [s for s in want if len(plan[s]) == world]
        return fail(
            "skips",
            f"no rank skipped step(s) {missed}, where some ranks' losses were NaN or inf and "
            f"the others' finite; only step(s) {every}, where every rank's was, were skipped. "
            "One bad rank was outvoted: the flag was reduced with MIN of 'bad' (or MAX of "
            "'ok'). Use MAX (or SUM) of 'bad' flags, or MIN of 'ok'",
        )
    if not done:
        return fail(
            "skips",
            f"no step was skipped, though some rank's loss was NaN or inf at steps {want}: "
            f"{name} returned True for them",
        )
    return fail(
        "skips",
        f"skipped steps {done}, want exactly {want} (where some rank's loss was NaN or inf)",
    )
