"""The exercises' pictures: when communication ran, step time against bucket size, optimizer state per rank.

    timeline(run, step=5)                 # run from timing.time_wrappers: one row per wrapper
    bucket_sweep(table)                   # columns implementation, bucket_mb, step ms, allreduces
    state_per_rank(rows, formula)         # rows from zero_runs.measure_state; formula: {world_size: bytes}

Each is shown once in a notebook (labkit.view.shown) and returned as a matplotlib Figure.
"""
from __future__ import annotations

from typing import Sequence

import pandas as pd
from matplotlib.figure import Figure

from ..records import Run
from ..view import COLORS, new_figure, shown


@shown
def timeline(run: Run, step: int | None = None, rank: int = 0, labels: Sequence[str] | None = None) -> Figure:
    """One step of each wrapper on rank `rank`: backward (grey), finish_gradient_synchronization() (orange) and
    each collective as a line from its launch (dot) to its completion, in ms from backward's start."""
    df = run.df[run.df["rank"] == rank]
    step = int(df.step_of.max()) if step is None else step
    rows = df[df.step_of == step].set_index("label")
    labels = list(labels) if labels is not None else list(rows.index)
    fig = new_figure(figsize=(11, 0.75 * len(labels) + 1.4))
    ax = fig.subplots()
    for y, label in enumerate(labels):
        row = rows.loc[label]
        backward, exposed = row.t_backward * 1e3, row.t_exposed * 1e3
        ax.barh(y, backward, height=0.8, color="#cfd8dc", label="backward" if y == 0 else None)
        ax.barh(y, exposed, left=backward, height=0.8, color="#ffcc80",
                label="finish_gradient_synchronization()" if y == 0 else None)
        events = sorted(row.timeline, key=lambda e: e[0])
        for k, (start, end, _) in enumerate(events):
            level = y - 0.3 + 0.6 * (k + 0.5) / len(events)
            ax.plot([start * 1e3, end * 1e3], [level, level], color=COLORS[y % len(COLORS)], linewidth=1.2)
            ax.plot(start * 1e3, level, "o", color=COLORS[y % len(COLORS)], markersize=2.5)
    ax.set_yticks(range(len(labels)), [f"{lab}\n{int(rows.loc[lab].allreduces)} all-reduces" for lab in labels],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms from the start of backward", title=f"step {step}, rank {rank}: backward and every all-reduce "
           "(dot: launched, line: until it completed)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="lower right")
    return fig


@shown
def bucket_sweep(table: pd.DataFrame, baselines: dict[str, tuple[float, float]] | None = None) -> Figure:
    """Step time and all-reduces per step against bucket size, one line per implementation; baselines
    {label: (ms per step, all-reduces per step)} are drawn flat (a wrapper without buckets, say)."""
    fig = new_figure(figsize=(12, 3.8))
    ax_time, ax_count = fig.subplots(1, 2)
    for color, (name, group) in zip(COLORS, table.groupby("implementation", sort=False)):
        group = group.sort_values("bucket_mb")
        ax_time.plot(group.bucket_mb, group["step ms"], "o-", color=color, label=name)
        ax_count.plot(group.bucket_mb, group.allreduces, "o-", color=color, label=name)
    for color, (name, (ms, count)) in zip(COLORS[len(COLORS) // 2:], (baselines or {}).items()):
        ax_time.axhline(ms, color=color, linestyle="--", label=name)
        ax_count.axhline(count, color=color, linestyle="--", label=name)
    ax_time.set(xscale="log", xlabel="bucket size (MB)", ylabel="ms per step (median, slowest rank)",
                title="step time against bucket size")
    ax_time.set_ylim(bottom=0)
    ax_count.set(xscale="log", yscale="log", xlabel="bucket size (MB)", ylabel="all-reduces per step",
                 title="messages per step")
    for ax in (ax_time, ax_count):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


@shown
def state_per_rank(rows: pd.DataFrame, formula: dict[int, float]) -> Figure:
    """Optimizer state bytes on each rank against world size, per optimizer, with the formula's line. Optimizers
    are drawn side by side around each world size (and with thinner lines), so that equal values stay visible."""
    fig = new_figure(figsize=(8, 4))
    ax = fig.subplots()
    worlds = sorted(formula)
    ax.plot(worlds, [formula[w] / 2**20 for w in worlds], "k--", linewidth=1, label="ZeRO-1 formula KΨ/N_d")
    groups = list(rows.groupby("optimizer", sort=False))
    for i, (color, marker, (name, group)) in enumerate(zip(COLORS, "osD^v", groups)):
        shift = 0.08 * (i - (len(groups) - 1) / 2)
        ax.scatter(group.world_size + shift, group.state_bytes / 2**20, color=color, marker=marker, alpha=0.5, s=22)
        largest = group.groupby("world_size").state_bytes.max()
        ax.plot(largest.index + shift, largest / 2**20, "-", marker=marker, color=color,
                linewidth=2.5 - 0.7 * i, label=f"{name} (line: fullest rank)")
    crowded = sorted(rows[rows.oversubscribed].world_size.unique())
    note = f"; {', '.join(map(str, crowded))} ranks oversubscribe the cores" if crowded else ""
    ax.set(xlabel="data-parallel ranks N_d", ylabel="MiB of optimizer state per rank",
           title=f"optimizer state per rank (markers: every rank{note})")
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
