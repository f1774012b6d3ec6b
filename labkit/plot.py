"""The kit's signature figure: throughput, loss and learning rate of several runs, side by side.

    fig = labkit.compare([run_a, run_b])                 # shows in a notebook; fig.savefig("ab.png") elsewhere
    fig = labkit.compare([run_a, run_b], x="samples")    # x axis in samples seen instead of steps

One column per quantity, one line per run, a shared x axis. The loss column shades each run's spread over ranks
(min to max of the ranks' local losses) and draws the task's loss floor when the runs share one.
"""
from __future__ import annotations

from typing import Sequence

from matplotlib.figure import Figure

from .records import Run

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def compare(runs: Sequence[Run], *, x: str = "step", labels: Sequence[str] | None = None,
            title: str | None = None) -> Figure:
    """Throughput | loss | LR for `runs`, one line each; x is "step" or "samples" (global samples seen)."""
    if x not in ("step", "samples"):
        raise ValueError(f"x = {x!r}: must be 'step' or 'samples'")
    _activate_notebook_display()
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    ax_tp, ax_loss, ax_lr = fig.subplots(1, 3, sharex=True)
    labels = list(labels) if labels is not None else [r.name for r in runs]
    for run, label, color in zip(runs, labels, COLORS * 4):
        steps = run.steps(run.read_records())
        if steps.empty:
            continue
        xs = steps["samples_seen"] if x == "samples" else steps["step"]
        ax_tp.plot(xs, steps["samples_per_s"], color=color, label=label)
        ax_loss.plot(xs, steps["loss"], color=color, label=label)
        ax_loss.fill_between(xs, steps["loss_min"], steps["loss_max"], color=color, alpha=0.2, linewidth=0)
        ax_lr.plot(xs, steps["lr"], color=color, label=label)
    floor = _shared_floor(runs)
    if floor is not None:
        ax_loss.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"loss floor {floor:.3f}")
    ax_tp.set(title="throughput (samples/s, all ranks)", ylabel="samples / s")
    ax_tp.set_ylim(bottom=0)
    ax_loss.set(title="loss (mean over ranks; band: spread over ranks)", ylabel="loss")
    ax_lr.set(title="learning rate", ylabel="lr")
    for ax in (ax_tp, ax_loss, ax_lr):
        ax.set_xlabel("global samples seen" if x == "samples" else "step")
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def _shared_floor(runs: Sequence[Run]) -> float | None:
    from .tasks import make_task
    floors = set()
    for run in runs:
        config = run.config
        if config is None:
            return None
        floors.add(make_task(config).loss_floor if config.task == "tinylm" else None)
    return floors.pop() if len(floors) == 1 else None


def _activate_notebook_display() -> None:
    """Teach IPython to show a Figure as PNG (pyplot's inline backend does it too, but only once activated)."""
    from .live import in_notebook
    if not in_notebook():
        return
    from IPython import get_ipython
    from IPython.core.pylabtools import print_figure
    png = get_ipython().display_formatter.formatters["image/png"]
    png.for_type(Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight"))


def curves(runs: Sequence[Run], column: str, *, x: str = "step", labels: Sequence[str] | None = None,
           title: str | None = None, ylabel: str | None = None) -> Figure:
    """One recorded quantity of several runs (mean over ranks), one line each:  curves(runs, "eval_accuracy")."""
    _activate_notebook_display()
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
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
