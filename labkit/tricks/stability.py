"""Loss spikes, NaNs and gradient clipping (lesson 09): what each rank saw, what each nan_policy did, what
clipping did, and where the clip must go under fp16 with accumulation.

    from labkit.tricks import stability
    stability.first_nonfinite(run)                  # the first step whose loss was not finite on some rank
    stability.per_rank(run, ("loss", "grad_norm"))  # figure: every rank's own curve, step by step
    stability.clipping(run)                         # per step: norm, max, whether clipping acted, the norm it left
    stability.clip_figure(runs)                     # figure: loss | grad norm (with each max) | clip coefficient
    stability.outcomes([(label, run, ending), ...]) # figure: how each nan_policy ended, per rank
    flags = launch(stability.flag_cost, config=cfg) # steps alternate without/with the nan_policy flag
    stability.flag_cost_summary(flags)              # ms per step each way, measured in the same run
    orders = launch(stability.clip_orders, config=cfg16)   # fp16 + accumulation: the norm each placement sees
    stability.clip_order_table(orders)

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

from ..records import Run
from ..training.amp import StepCounter, autocast
from ..training.loop import make_optimizer
from ..training.seeding import seed_everything
from ..training.stability import NanGuard, optimizer_step
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


def flag_cost(ctx: Any) -> None:
    """Train ctx.config with steps alternating without and with nan_policy="stop"'s flag (its gradient checks and
    its all-reduce), so that both kinds of step share the machine's load; records t_step, flag (0/1) and t_flag
    (the seconds spent agreeing, waiting for the slower rank included)."""
    task, model, ddp, optimizer = _ddp_setup(ctx)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)
    guard = NanGuard("stop", model, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
    for step in range(ctx.config.steps):
        ctx.heartbeat(step)
        flagged = step % 2 == 1
        guard.armed = flagged
        started = time.perf_counter()
        guard.start_step()
        inputs, targets = (t.to(ctx.device) for t in task.batch(step, 0, ctx.rank))
        loss, _ = task.loss(ddp, inputs, targets)
        loss.backward()
        value = loss.item()
        agreeing = time.perf_counter()
        bad = guard.agree(value) if flagged else []
        t_flag = time.perf_counter() - agreeing
        optimizer_step(model, optimizer, scaler, None, take=not bad)
        ctx.record(step, loss=value, t_step=time.perf_counter() - started, flag=int(flagged), t_flag=t_flag)


def flag_cost_summary(run: Run) -> dict[str, float]:
    """Per step the slowest rank's time; the medians without and with the flag; the flag's cost as the median
    of the differences within each (without, with) pair of neighbouring steps, with their quartiles (the noise
    of this machine); and the median time spent inside the agreement itself."""
    df = run.read_records()
    steps = df[df["step"] >= WARM].groupby("step").agg(t_step=("t_step", "max"), flag=("flag", "first"),
                                                      t_flag=("t_flag", "max"))
    ms = steps["t_step"] * 1e3
    pairs = pd.DataFrame({"without": ms[steps["flag"] == 0].values[:len(ms) // 2],
                          "with": ms[steps["flag"] == 1].values[:len(ms) // 2]}).dropna()
    diff = pairs["with"] - pairs["without"]
    without = float(pairs["without"].median())
    return {"ms_without": without, "ms_with": float(pairs["with"].median()), "ms_cost": float(diff.median()),
            "ms_cost_q25": float(diff.quantile(0.25)), "ms_cost_q75": float(diff.quantile(0.75)),
            "cost_percent": float(100 * diff.median() / without), "pairs": len(pairs),
            "ms_in_agreement": float(steps.loc[steps["flag"] == 1, "t_flag"].median() * 1e3)}


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
