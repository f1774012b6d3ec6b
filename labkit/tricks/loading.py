"""Where a step's time goes when data loading is the question: the split of a step, and its picture (lesson 05).

    split = step_split(run)               # {"t_data": 0.031, "t_fwd_bwd": 0.004, "t_optim": 0.001, "t_step": 0.037}
    ours, others = cores_busy(run, meter) # cores kept busy during the averaged steps (a measure.CpuMeter)
    fig = plot_step_split(table)          # stacked bars, one per setting
"""
from __future__ import annotations

import math
from typing import Any

from matplotlib.figure import Figure

from ..measure.cores import CpuMeter
from ..view import COLORS, new_figure, shown

PARTS = ("t_data", "t_fwd_bwd", "t_optim")


def step_split(run: Any, warmup: int = 4) -> dict[str, float]:
    """Mean seconds per step of t_data, t_fwd_bwd, t_optim and t_step (averaged over ranks, so the parts add up),
    skipping `warmup` steps and the last one (it also stops the workers):  step_split(run) -> {"t_data": 0.031, ...}.

    The mean, not the median: workers side by side finish batches in bunches, so the waits are uneven (long ones,
    then short ones while ready batches are taken). The median of such a series can be a short wait; the mean is
    the total wait per step, which is what decides the throughput."""
    df = run.df
    df = df[(df.step >= warmup) & (df.step < df.step.max())] if df.step.max() > warmup else df
    per_step = df.groupby("step")[[*PARTS, "t_step"]].mean()
    return {name: float(per_step[name].mean()) for name in per_step}


def cores_busy(run: Any, meter: CpuMeter, warmup: int = 4) -> tuple[float, float]:
    """(ours, others) over the steps step_split averages: after `warmup`, before the last."""
    times = run.df.groupby("step")["time"].max()
    if len(times) <= warmup + 1:
        return math.nan, math.nan
    return meter.cores_busy(times.iloc[max(warmup - 1, 0)], times.iloc[-2])


@shown
def plot_step_split(table: Any, *, floor_s: float | None = None, notes: Any = None, title: str | None = None) -> Any:
    """Stacked bars, one per setting (rows of `table`: t_data, t_fwd_bwd, t_optim, t_step in seconds); a black line
    marks the step time, a dashed one `floor_s`; `notes` (one string per row) go above the bars:
    plot_step_split(table, floor_s=0.016, notes=[f"{u:.1f} cores busy" for u in table["cores busy"]])."""
    fig = new_figure(figsize=(max(8.0, 1.1 * len(table) + 4), 4.5))
    ax = fig.subplots()
    xs, bottom = range(len(table)), [0.0] * len(table)
    names = {"t_data": "waiting for data (t_data)", "t_fwd_bwd": "forward + backward (t_fwd_bwd)",
             "t_optim": "optimizer (t_optim)"}
    for part, color in zip(PARTS, [COLORS[3], COLORS[0], COLORS[2]]):
        heights = [1e3 * v for v in table[part]]
        ax.bar(xs, heights, bottom=bottom, color=color, label=names[part], width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.hlines([1e3 * v for v in table["t_step"]], [x - 0.35 for x in xs], [x + 0.35 for x in xs], color="black",
              linewidth=2, zorder=3, label="step time (t_step)")
    for x, top, note in zip(xs, table["t_step"], notes if notes is not None else []):
        ax.annotate(note, (x, 1e3 * top), xytext=(0, 6), textcoords="offset points", ha="center", fontsize=8)
    if floor_s is not None:
        ax.axhline(1e3 * floor_s, color="black", linestyle="--", linewidth=1,
                   label=f"floor: sample work / cores = {1e3 * floor_s:.0f} ms")
    ax.set_xticks(list(xs), [str(i).replace(", ", "\n") for i in table.index], fontsize=9)
    ax.set(ylabel="ms per step (mean after warm-up)", title=title or "")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
