"""The kit's signature figure: throughput, loss and learning rate of several runs, side by side.

    fig = labkit.compare([run_a, run_b])                 # shown once in a notebook; fig.savefig("ab.png") anywhere
    fig = labkit.compare([run_a, run_b], x="samples")    # x axis in samples seen instead of steps
    fig = labkit.compare(runs, smooth=5)                 # throughput as a running mean of 5 steps (raw line faint)
    fig = curves(runs, "grad_norm")                      # any recorded quantity, mean over ranks

One column per quantity, one line per run, a shared x axis. The loss column shades each run's spread over ranks
(min to max of the ranks' local losses) and draws the task's loss floor when the runs share one.
"""
from __future__ import annotations

from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, ScalarFormatter

from ..records import Run
from .show import new_figure, shown

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
LR_STYLES = ["-", (0, (5, 3)), (0, (1, 2)), (0, (6, 2, 1, 2))]


@shown
def compare(runs: Sequence[Run], *, x: str = "step", labels: Sequence[str] | None = None,
            title: str | None = None, smooth: int = 1) -> Figure:
    """Throughput | loss | LR for `runs`, one line each; x is "step" or "samples" (global samples seen);
    smooth > 1 draws throughput as a running mean over that many steps, over the raw line drawn faint."""
    return compare_figure(runs, x=x, labels=labels, title=title, smooth=smooth)


def compare_figure(runs: Sequence[Run], *, x: str = "step", labels: Sequence[str] | None = None,
                   title: str | None = None, smooth: int = 1) -> Figure:
    """compare() without showing the figure (the live view redraws it in place)."""
    if x not in ("step", "samples"):
        raise ValueError(f"x = {x!r}: must be 'step' or 'samples'")
    if not isinstance(smooth, int) or isinstance(smooth, bool) or smooth < 1:
        raise ValueError(f"smooth = {smooth!r}: must be an integer >= 1 (steps in the running mean)")
    fig = new_figure(figsize=(15, 4.2))
    ax_tp, ax_loss, ax_lr = fig.subplots(1, 3, sharex=True)
    labels = list(labels) if labels is not None else [r.name for r in runs]
    for i, (run, label, color) in enumerate(zip(runs, labels, COLORS * 4)):
        steps = run.steps(run.read_records())
        if steps.empty:
            continue
        xs = steps["samples_seen"] if x == "samples" else steps["step"]
        if "samples_per_s" in steps:
            throughput = steps["samples_per_s"]
            if smooth > 1:
                ax_tp.plot(xs, throughput, color=color, alpha=0.25, linewidth=1)
                throughput = throughput.rolling(smooth, min_periods=1).mean()
            ax_tp.plot(xs, throughput, color=color, label=label)
        ax_loss.plot(xs, steps["loss"], color=color, label=label)
        ax_loss.fill_between(xs, steps["loss_min"], steps["loss_max"], color=color, alpha=0.2, linewidth=0)
        if "lr" in steps:  # runs often share a schedule: dashes keep a line visible under the one drawn after it
            ax_lr.plot(xs, steps["lr"], color=color, label=label, linestyle=LR_STYLES[i % len(LR_STYLES)],
                       linewidth=1.5 + 0.5 * (len(runs) - 1 - i))
    floor = _shared_floor(runs)
    if floor is not None:
        ax_loss.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"loss floor {floor:.3f}")
    smoothed = f", running mean of {smooth} steps" if smooth > 1 else ""
    ax_tp.set(title=f"throughput (samples/s, all ranks{smoothed})", ylabel="samples / s")
    ax_tp.set_ylim(bottom=0)
    ax_loss.set(title="loss (mean over ranks; band: spread over ranks)", ylabel="loss")
    ax_lr.set(title="learning rate", ylabel="lr")
    _readable_lr_axis(ax_lr)
    for ax in (ax_tp, ax_loss, ax_lr):
        ax.set_xlabel("global samples seen" if x == "samples" else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and samples are whole numbers
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def _readable_lr_axis(ax) -> None:
    """From 0 to a little above the highest LR, in plain scientific ticks: a constant LR would otherwise get an
    axis zoomed onto one value, with an offset label (1e-3 + 2e-19) that reads like noise."""
    top = max((line.get_ydata().max() for line in ax.get_lines() if len(line.get_ydata())), default=0.0)
    if top > 0:
        ax.set_ylim(0, top * 1.15)
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_powerlimits((-2, 3))
    ax.yaxis.set_major_formatter(formatter)


def _shared_floor(runs: Sequence[Run]) -> float | None:
    floors = set()
    for run in runs:
        config = run.config
        if config is None:
            return None
        floors.add(config.loss_floor)
    return floors.pop() if len(floors) == 1 else None


@shown
def curves(runs: Sequence[Run], column: str, *, x: str = "step", labels: Sequence[str] | None = None,
           title: str | None = None, ylabel: str | None = None) -> Figure:
    """One recorded quantity of several runs (mean over ranks), one line each:  curves(runs, "eval_accuracy")."""
    fig = new_figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    labels = list(labels) if labels is not None else [r.name for r in runs]
    for run, label, color in zip(runs, labels, COLORS * 4):
        df = run.read_records()
        if column not in df:
            raise KeyError(f"run {run.name!r} recorded no {column!r}; it has {sorted(df.columns)}")
        points = df.dropna(subset=[column]).groupby(x)[column].mean()
        ax.plot(points.index, points.values, "o-", markersize=3, color=color, label=label)
    ax.set(xlabel=x, ylabel=ylabel or column, title=title or f"{column} (mean over ranks)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
