"""Loss spikes, NaNs and gradient clipping (lesson 09): what each rank saw, what each nan_policy did, what
clipping did, and where the clip must go under fp16 with accumulation.

    from labkit.tricks import stability
    stability.first_nonfinite(run)                  # the first step whose loss was not finite on some rank
    stability.per_rank(run, ("loss", "grad_norm"))  # figure: every rank's own curve, step by step
    stability.clipping(run)                         # per step: norm, max, whether clipping acted, the norm it left
    stability.clip_figure(runs)                     # figure: loss | grad norm (with each max) | clip coefficient
    stability.outcomes([(label, run, ending), ...]) # figure: how each nan_policy ended, per rank
    stability.everyone_waited(failure)              # "alone": nobody failed, every rank still waiting when reported
    stability.stopped_together(run, step)           # "stop": every rank's last step is `step`, and none took it
    stability.hung_in_barrier(failure, rank=1)      # "alone": (what was seen, verdict) for the rank that quit,
    stability.waits_in_torch(failure, 0, step=6)    # for its peer, blocked in the next step's collective,
    stability.names_the_culprit(failure, 1, step=5) # and "stop"'s failure: the rank, step and first bad gradient
    flags = launch(stability.flag_cost, config=cfg) # steps take turns: with/without the nan_policy flag, at the
                                                    # config's batch and at GROWTH times it
    summary = stability.flag_cost_summary(flags)    # per batch: the step, the flag's checks, round trip and wait (ms),
                                                    # its share of the step; the paired difference as a cross-check
    stability.flag_share_falls(summary)             # True: a price per step, a smaller share of a longer step
    stability.flag_traffic(flags)                   # the agreement's collectives and bytes, counted
    orders = launch(stability.clip_orders, config=cfg16)   # fp16 + accumulation: the norm each placement sees
    stability.clip_order_table(orders)
    stability.skipped_steps(run)                    # a hand-written loop's records: {rank: steps it skipped}
    stability.clip_returned_norm_before(run, 5.0)   # its clip_grad_norm_ returned the norm before clipping
    stability.weights_match(run)                    # every rank returned the same finite tensors

Everything is read from records the ranks wrote; the workers here are launched like any function fn(ctx).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Sequence

import pandas as pd
import torch
from matplotlib.figure import Figure
from torch.nn.parallel import DistributedDataParallel as DDP

from ..measure import Bound, above, below
from ..records import Run
from ..run.failure import RankFailure
from ..training.amp import StepCounter, autocast
from ..training.commhooks import count_collectives
from ..training.optim import make_optimizer
from ..training.seeding import seed_everything
from ..training.nonfinite import NanGuard, optimizer_step
from ..training.tasks import make_task
from ..view import COLORS, new_figure, shown

WARM = 2  # steps left out of timings: the first DDP steps pay one-off costs


def first_nonfinite(run: Run, column: str = "loss") -> int | None:
    """The first step at which `column` was not finite on some rank (None: finite throughout)."""
    df = run.read_records()
    bad = df.loc[~df[column].apply(lambda v: math.isfinite(v) if v is not None else False), "step"]
    return int(bad.min()) if len(bad) else None


def clipping(run: Run) -> pd.DataFrame:
    """One row per step (rank 0's record; the norm is the averaged gradients', the same on every rank):
    grad_norm before clipping, max_norm, acted (clip_coef < 1: clipping scaled the gradients) and left (the norm
    it left, grad_norm * clip_coef, measured after clipping)."""
    df = run.read_records()
    rows = df[df["rank"] == 0].set_index("step")
    out = pd.DataFrame({"grad_norm": rows["grad_norm"], "max_norm": run.config.clip_norm,
                        "clip_coef": rows["clip_coef"]})
    out["acted"] = out["clip_coef"] < 1.0
    out["left"] = out["grad_norm"] * out["clip_coef"]
    return out


def everyone_waited(failure: RankFailure) -> bool:
    """Whether every rank was still waiting when the watchdog reported (state "hung" or "waiting"): nobody failed,
    the job only stopped moving, as under nan_policy="alone":  everyone_waited(failure) -> True."""
    return all(s.state in ("hung", "waiting") for s in failure.statuses)


def hung_in_barrier(failure: RankFailure, rank: int) -> tuple[str, bool]:
    """Whether the watchdog reported `rank` hung in a barrier (where nan_policy="alone" leaves the rank that quit its
    loop):  hung_in_barrier(failure, rank=1) -> ("hung: rank 1, in barrier", True)."""
    where = "in barrier" if "barrier" in failure.detail else "elsewhere"
    return f"{failure.reason}: rank {failure.rank}, {where}", (failure.reason, failure.rank, where) == \
        ("hung", rank, "in barrier")


def waits_in_torch(failure: RankFailure, rank: int, step: int) -> tuple[str, bool]:
    """Whether `rank` was waiting inside a torch call at `step` when the watchdog reported (a peer blocked in a
    collective the quitter never joins):  waits_in_torch(failure, rank=0, step=6) -> ("rank 0 at step 6: ...", True)."""
    status = failure.statuses[rank]
    return f"rank {rank} at step {status.step}: {status.detail.split(' (')[0]}", \
        "waiting inside torch" in status.detail and status.step == step


def names_the_culprit(failure: RankFailure, rank: int, step: int) -> tuple[str, bool]:
    """Whether a nan_policy="stop" failure names `rank`, `step` and the first parameter whose gradient went
    non-finite:  names_the_culprit(failure, rank=1, step=5) -> ("rank 1, step 5, transformer.h.0...", True)."""
    marker = "first non-finite gradient (in backward's order): "
    param = failure.detail.split(marker)[1].split(" ")[0].rstrip(".,") if marker in failure.detail else None
    return f"rank {failure.rank}, step {failure.step}, {param}", (failure.rank, failure.step) == (rank, step) and \
        param is not None


def stopped_together(run: Run, step: int) -> bool:
    """Whether every rank of the run recorded `step` as its last step and none of them took its optimizer step there
    (skipped_step 1), as nan_policy="stop" promises:  stopped_together(failure.run, 5) -> True."""
    df = run.df
    last, at = df.groupby("rank")["step"].max(), df[df["step"] == step]
    return bool(len(last) == run.world_size and (last == step).all() and len(at) == run.world_size
                and (at["skipped_step"] == 1).all())


@shown
def per_rank(run: Run, columns: Sequence[str] = ("loss", "grad_norm"), *, mark: int | None = None,
             log: bool = True, title: str | None = None) -> Figure:
    """One panel per column, one line per rank: what each rank recorded, step by step; `mark` draws a step."""
    df = run.read_records()
    fig = new_figure(figsize=(5.5 * len(columns), 3.8))
    axes = fig.subplots(1, len(columns), squeeze=False)[0]
    for ax, column in zip(axes, columns):
        for rank, rows in df.groupby("rank"):
            ax.plot(rows["step"], rows[column], "o-", markersize=3, color=COLORS[int(rank) % len(COLORS)],
                    label=f"rank {rank}", alpha=0.8)
        if mark is not None:
            ax.axvline(mark, color="gray", linestyle=":", label=f"step {mark}")
        ax.set(xlabel="step", ylabel=column, title=f"{column} per rank", yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or run.name)
    return fig


@shown
def clip_figure(runs: Sequence[Run], labels: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """Loss | grad norm before clipping (each run's max dashed) | clip coefficient, one line per run (rank 0;
    non-finite values leave gaps, marked with an x where each run's loss went)."""
    fig = new_figure(figsize=(16, 4.2))
    ax_loss, ax_norm, ax_coef = fig.subplots(1, 3, sharex=True)
    labels = list(labels) if labels is not None else [r.name for r in runs]
    for run, label, color in zip(runs, labels, COLORS * 4):
        df = run.read_records()
        rows = df[df["rank"] == 0]
        ax_loss.plot(rows["step"], rows["loss"], color=color, label=label)
        ax_norm.plot(rows["step"], rows["grad_norm"], color=color, label=label)
        if run.config.clip_norm is not None:  # without clipping the coefficient is 1.0 by definition
            ax_coef.plot(rows["step"], rows["clip_coef"], "o-", markersize=2, color=color, label=label)
        finite = rows[rows["loss"].apply(math.isfinite)]
        if len(finite) < len(rows) and len(finite):
            ax_loss.plot(finite["step"].iloc[-1:], finite["loss"].iloc[-1:], "x", color=color, markersize=10)
        if run.config.clip_norm is not None:
            ax_norm.axhline(run.config.clip_norm, color=color, linestyle="--", linewidth=1)
    ax_loss.set(title="loss (rank 0; x: the last finite step)", ylabel="loss", yscale="log")
    ax_norm.set(title="gradient norm before clipping (dashed: max)", ylabel="norm", yscale="log")
    ax_coef.set(title="clip coefficient (norm left / norm before)", ylabel="coefficient", ylim=(0, 1.05))
    for ax in (ax_loss, ax_norm, ax_coef):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


@shown
def outcomes(items: Sequence[tuple[str, Run, str]], *, mark: int | None = None) -> Figure:
    """One panel per (label, run, how it ended): each rank's loss per step; a non-finite loss is an X along the
    top edge, a step whose optimizer step did not happen a triangle along the bottom edge, in the rank's colour."""
    fig = new_figure(figsize=(5.2 * len(items), 4.0))
    axes = fig.subplots(1, len(items), sharey=True, squeeze=False)[0]
    for ax, (label, run, ending) in zip(axes, items):
        df = run.read_records()
        edge = ax.get_xaxis_transform()  # x in steps, y as a fraction of the panel's height
        for rank, rows in df.groupby("rank"):
            color = COLORS[int(rank) % len(COLORS)]
            finite = rows["loss"].apply(math.isfinite)
            ax.plot(rows["step"], rows["loss"].where(finite), "o-", markersize=3, color=color,
                    label=f"rank {rank} (last record: step {int(rows['step'].max())})")
            ax.plot(rows.loc[~finite, "step"], [0.95] * int((~finite).sum()), "X", color=color, markersize=10,
                    transform=edge)
            skipped = rows[rows["skipped_step"] == 1] if "skipped_step" in rows else rows.iloc[:0]
            ax.plot(skipped["step"], [0.04 + 0.05 * int(rank)] * len(skipped), "v", color=color, markersize=8,
                    transform=edge)
        if mark is not None:
            ax.axvline(mark, color="gray", linestyle=":")
        ax.set(title=f"{label}\n{ending}", xlabel="step", ylabel="loss")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("one rank's loss turns NaN (X, top edge; dotted: its step); triangles: optimizer steps not taken")
    return fig


# --- workers, launched like any fn(ctx) --------------------------------------------------------------------------

def _ddp_setup(ctx: Any) -> tuple[Any, torch.nn.Module, DDP, torch.optim.Optimizer]:
    config = ctx.config
    seed_everything(config.seed)
    task = make_task(config, ctx.world_size)
    model = task.build_model().to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return task, model, ddp, make_optimizer(config, model.parameters())


GROWTH = 4  # flag_cost times the flag at the config's batch and at GROWTH times it, in the same run
KINDS = ((1, 0), (1, 1), (GROWTH, 0), (GROWTH, 1))   # (batch multiple, flag) of flag_cost's four kinds of step


def flag_kind(step: int) -> tuple[int, int]:
    """(batch multiple, flag) of flag_cost's step: the four kinds in turns, ABCD DCBA ..., so that each kind sits
    at every place of a block alike:  [flag_kind(s) for s in range(8)] -> (1,0) (1,1) (4,0) (4,1) (4,1) (4,0) ..."""
    place = step % len(KINDS)
    return KINDS[place if (step // len(KINDS)) % 2 == 0 else len(KINDS) - 1 - place]


def flag_cost(ctx: Any) -> None:
    """Train ctx.config with four kinds of step taking turns (flag_kind): at the config's batch and at GROWTH
    times it (its rows repeated: the work of GROWTH times the rows), each without and with nan_policy="stop"'s flag,
    so that every kind shares the machine's load alike. Records t_step, rows (per rank), flag (0/1) and the flag's
    two parts, timed where they run: t_checks (seconds inside the guard's gradient hooks during backward, between
    hooks registered just before and just after them on each parameter) and t_flag (seconds in the agreement, the
    wait for the slower rank included); flag_calls / flag_bytes: the collectives the agreement issued and the
    bytes handed to them, counted at torch.distributed."""
    task, model, ddp, optimizer = _ddp_setup(ctx)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)
    params = [p for p in model.parameters() if p.requires_grad]
    inside = [0.0]   # seconds inside the guard's hooks this step; then the time its current hook began
    for p in params:  # a parameter's post-accumulate hooks run in the order they were registered
        p.register_post_accumulate_grad_hook(lambda _: inside.append(time.perf_counter()))
    guard = NanGuard("stop", model, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: inside.__setitem__(0, inside[0] + time.perf_counter()
                                                                          - inside.pop()))
    with count_collectives() as wire:
        for step in range(ctx.config.steps):
            ctx.heartbeat(step)
            times, flagged = flag_kind(step)
            guard.armed, inside[0] = bool(flagged), 0.0
            started = time.perf_counter()
            guard.start_step()
            inputs, targets = (t.to(ctx.device).repeat(times, *[1] * (t.dim() - 1))
                               for t in task.batch(step, 0, ctx.rank))
            loss, _ = task.loss(ddp, inputs, targets)
            loss.backward()
            value = loss.item()
            wire.take()  # forget anything before the agreement: only the flag's own collectives are counted
            agreeing = time.perf_counter()
            bad = guard.agree(value) if flagged else []
            t_flag = time.perf_counter() - agreeing
            calls, sent = wire.take()
            optimizer_step(model, optimizer, scaler, None, take=not bad)
            ctx.record(step, loss=value, t_step=time.perf_counter() - started, rows=len(inputs), flag=flagged,
                       tensors=len(params), t_checks=inside[0], t_flag=t_flag, flag_calls=calls, flag_bytes=sent)


def flag_cost_summary(run: Run) -> pd.DataFrame:
    """One row per batch size (rows per rank) of a flag_cost run, in ms (medians over steps):
    - step: a step without the flag (its slowest rank);
    - checks: the checks of the `tensors` gradients, at the slowest rank (time inside the guard's hooks on flagged
      steps, less that on unflagged ones, where the hooks do nothing);
    - round_trip: the agreement's all-reduce as the last rank to arrive lives it (the least time a rank spent in
      the agreement); wait: how much longer the first rank to arrive spent there, waiting for the last;
    - least, most: what the flag adds to a step, checks + round_trip, and that plus the wait. The truth is between:
      the wait is the ranks' drift since the gradient all-reduce, which the next one would absorb anyway unless
      the drift changes sides in between; share_least, share: least and most as a share of the step, in %;
    - paired, q25, q75, pairs: the median difference of step time with and without the flag within each turn of
      the four kinds, and its quartiles: the cross-check, and the noise of single steps."""
    df = run.read_records()
    steps = df[df["step"] >= WARM].groupby("step").agg(rows=("rows", "first"), flag=("flag", "first"),
                                                      tensors=("tensors", "first"), t_step=("t_step", "max"),
                                                      t_checks=("t_checks", "max"), round_trip=("t_flag", "min"),
                                                      first=("t_flag", "max"))
    steps["wait"] = steps["first"] - steps["round_trip"]
    steps["turn"] = steps.index // len(KINDS)
    out = []
    for rows, kind in steps.groupby("rows"):
        ms = kind.groupby("flag")[["t_step", "t_checks", "round_trip", "wait"]].median() * 1e3
        paired = kind.pivot_table(index="turn", columns="flag", values="t_step").dropna() * 1e3
        diff = paired[1] - paired[0]
        step, checks, round_trip, wait = ms.loc[0, "t_step"], ms.loc[1, "t_checks"] - ms.loc[0, "t_checks"], \
            ms.loc[1, "round_trip"], ms.loc[1, "wait"]
        out.append({"rows": int(rows), "tensors": int(kind["tensors"].iloc[0]), "step": step, "checks": checks,
                    "round_trip": round_trip, "wait": wait, "least": checks + round_trip,
                    "most": checks + round_trip + wait, "share_least": 100 * (checks + round_trip) / step,
                    "share": 100 * (checks + round_trip + wait) / step, "paired": diff.median(),
                    "q25": diff.quantile(0.25), "q75": diff.quantile(0.75), "pairs": len(diff)})
    return pd.DataFrame(out).set_index("rows")


def flag_share_falls(summary: pd.DataFrame) -> bool:
    """Whether the flag's price is one per step rather than per sample, as flag_cost_summary measured it: at the
    larger batch the step took longer, and the most the flag adds (its wait included, which grows with the drift
    of longer steps) was a smaller share of it:  flag_share_falls(summary) -> True."""
    small, large = summary.sort_index().iloc[0], summary.sort_index().iloc[-1]
    return all([above(large["step"] / small["step"], 1, "step without the flag, larger / smaller batch"),
                below(large["share"], small["share"], "most the flag adds, % of the larger batch's step, "
                                                     "against the smaller's")])


def flag_traffic(run: Run) -> dict[str, float]:
    """What the agreement handed to torch.distributed, counted per rank: flag_calls and flag_bytes (medians over
    flagged steps) and bytes_unflagged (the most any unflagged step sent there)."""
    df = run.read_records()
    return {"flag_calls": float(df.loc[df["flag"] == 1, "flag_calls"].median()),
            "flag_bytes": float(df.loc[df["flag"] == 1, "flag_bytes"].median()),
            "bytes_unflagged": float(df.loc[df["flag"] == 0, "flag_bytes"].max())}


def clip_orders(ctx: Any) -> None:
    """fp16 autocast, a GradScaler and grad_accum micro-batches per step (DDP syncs on the last one). After the
    last micro-batch, on the same gradients, measure both placements of a clip at config.clip_norm:
    before unscale (on copies: clip the scaled gradients, then unscale them) and after unscale (for real, then
    step). Records loss_scale, norm_scaled (what a clip before unscale measures), grad_norm (the true norm),
    left_before / left_after (the norm each placement hands the optimizer) and skipped_step."""
    config = ctx.config
    task, model, ddp, optimizer = _ddp_setup(ctx)
    scaler = torch.amp.GradScaler(ctx.device.type)
    params = list(model.parameters())
    taken = StepCounter(optimizer)
    for step in range(config.steps):
        ctx.heartbeat(step)
        for micro in range(config.grad_accum):
            inputs, targets = (t.to(ctx.device) for t in task.batch(step, micro, ctx.rank))
            last = micro == config.grad_accum - 1
            with (contextlib.nullcontext() if last else ddp.no_sync()), autocast("fp16", ctx.device):
                loss, _ = task.loss(ddp, inputs, targets)
            scaler.scale(loss / config.grad_accum).backward()
        scale = scaler.get_scale()
        copies = [torch.zeros_like(p) for p in params]
        for copy, p in zip(copies, params):
            copy.grad = p.grad.detach().clone()
        norm_scaled = torch.nn.utils.clip_grad_norm_(copies, config.clip_norm).item()   # the wrong place
        left_before = torch.nn.utils.get_total_norm([c.grad for c in copies]).item() / scale
        scaler.unscale_(optimizer)                                                       # the right place
        true_norm = torch.nn.utils.clip_grad_norm_(params, config.clip_norm).item()
        left_after = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
        before = taken.steps
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        skipped = int(taken.steps == before)
        ctx.record(step, loss=loss.item(), loss_scale=scale, norm_scaled=norm_scaled, grad_norm=true_norm,
                   left_before=left_before, left_after=left_after, skipped_step=skipped)


def clip_order_table(run: Run) -> pd.DataFrame:
    """Rank 0's steps that GradScaler did not skip: loss_scale, norm_scaled / grad_norm (what a clip before unscale
    mistakes the norm for), and the norm each placement left."""
    df = run.read_records()
    rows = df[(df["rank"] == 0) & (df["skipped_step"] == 0)].set_index("step")
    out = rows[["loss_scale", "norm_scaled", "grad_norm", "left_before", "left_after"]].copy()
    out["seen / true"] = out["norm_scaled"] / out["grad_norm"]
    return out


# --- a loop written by hand (the lesson's fn(ctx): clip_grad_norm_, then an all-reduced flag) ---------------------

def skipped_steps(run: Run, column: str = "skipped") -> dict[int, list[int]]:
    """Per rank, the steps it recorded with `column` == 1:  skipped_steps(run) -> {0: [3], 1: [3]}."""
    return {int(rank): sorted(int(s) for s in rows.loc[rows[column] == 1, "step"])
            for rank, rows in run.df.groupby("rank")}


def clip_returned_norm_before(run: Run, max_norm: float, rank: int = 0) -> tuple[str, bool | Bound]:
    """Whether the "norm" a loop recorded from clip_grad_norm_ is the norm before clipping, read against "left" (the
    norm measured after it): left is max_norm where norm was above it and norm itself elsewhere. Finite steps on
    both sides of max_norm are required, since with none above, a norm taken after clipping passes too.
    Returns what was measured and the verdict:  clip_returned_norm_before(run, 5.0) -> ("3 of 7 ...", True)."""
    rows = run.df[run.df["rank"] == rank]
    rows = rows[rows["norm"].apply(math.isfinite)]
    gap = float(((rows["left"] - rows["norm"].clip(upper=max_norm)).abs() / max_norm).max()) if len(rows) else math.inf
    over = int((rows["norm"] > max_norm).sum())
    ok = 1 <= over < len(rows) and below(gap, 1e-4, "worst |left - min(norm, max)| / max")
    return f"{over} of {len(rows)} finite steps above {max_norm}; worst gap to min(norm, max) {gap:.1e}", ok


def weights_match(run: Run) -> tuple[float, bool]:
    """The largest difference between rank 0's returned tensors and another rank's, and whether every rank returned
    finite tensors equal to rank 0's:  weights_match(run) -> (0.0, True)."""
    first = run.result(0)
    others = [run.result(r) for r in range(1, run.world_size)]
    gap = max((float((a - b).abs().max()) for other in others for a, b in zip(first, other)), default=0.0)
    finite = all(bool(torch.isfinite(t).all()) for tensors in [first, *others] for t in tensors)
    return gap, finite and gap == 0.0 and all(len(o) == len(first) for o in others)
