"""Learning-rate schedules (lesson 10): the LR the ranks recorded against the schedule's own function, the
ranks' agreement, warmup's effect on an early spike, and restarts.

    from labkit.tricks import schedules
    schedules.reference_lrs(cfg)          # transformers' own scheduler, stepped as a training loop steps it
    schedules.lr_mismatch(run)            # largest |recorded LR - schedule's LR| over every step and rank
    run.lr_disagreement()                 # the first step where the ranks' LRs differ (labkit.records)
    schedules.rank_lrs(run)               # figure: each rank's held-out loss and LR (the per-rank plateau bug)
    schedules.early_climb(run, within=10) # how far the loss climbed back above its first value, and when
    schedules.restart_steps(run)          # steps at which the LR jumped back up
    schedules.tail_loss(run, last=5)      # mean loss of the last steps
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import torch
from matplotlib.figure import Figure

from ..config import RunConfig
from ..records import Run
from ..training.schedule import TRANSFORMERS, lr_for_config
from ..view import COLORS, new_figure, shown


def reference_lrs(config: RunConfig) -> list[float]:
    """The LR of each of config.steps optimizer steps, from the schedule's own source: for transformers' schedules,
    their LambdaLR driven the usual way (read the LR, optimizer.step(), scheduler.step()); for labkit's own, its
    pure function. Not defined for "plateau", whose LR follows the held-out loss."""
    if config.schedule == "plateau":
        raise ValueError("schedule = 'plateau' follows the held-out loss: compare the ranks (Run.lr_disagreement)")
    if config.schedule not in TRANSFORMERS:
        return [lr_for_config(step, config) for step in range(config.steps)]
    from transformers import get_scheduler
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    name, extra = {"cosine_restarts": ("cosine_with_restarts", {"num_cycles": config.cycles}),
                   "polynomial": ("polynomial", {"lr_end": config.lr * config.min_lr_ratio,
                                                 "power": config.poly_power})}[config.schedule]
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=config.warmup_steps,
                              num_training_steps=config.steps, scheduler_specific_kwargs=extra)
    out = []
    for _ in range(config.steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def lr_mismatch(run: Run) -> float:
    """The largest |recorded LR - reference_lrs| over every step and rank (0.0: equal everywhere)."""
    df = run.read_records()
    expected = pd.Series(reference_lrs(run.config))
    return float((df["lr"] - df["step"].map(expected)).abs().max())


@shown
def rank_lrs(run: Run, title: str | None = None) -> Figure:
    """Held-out loss (each rank's shard; the all-reduced one dashed) | LR, one line per rank."""
    df = run.read_records()
    fig = new_figure(figsize=(12, 3.8))
    ax_eval, ax_lr = fig.subplots(1, 2, sharex=True)
    for rank, rows in df.groupby("rank"):
        color = COLORS[int(rank) % len(COLORS)]
        evals = rows.dropna(subset=["eval_loss_rank"])
        ax_eval.plot(evals["step"], evals["eval_loss_rank"], "o-", markersize=3, color=color,
                     label=f"rank {rank}: its own shard")
        ax_lr.step(rows["step"], rows["lr"], where="post", color=color, label=f"rank {rank}",
                   linewidth=2.5 if rank == 0 else 1.2)
    fed = df.dropna(subset=["eval_loss"]).groupby("step")["eval_loss"]
    if not run.config.plateau_per_rank:
        ax_eval.plot(fed.first().index, fed.first().values, "k--", label="all-reduced (what every scheduler gets)")
    split = run.lr_disagreement()
    if split is not None:
        ax_lr.axvline(split, color="gray", linestyle=":", label=f"ranks differ from step {split}")
    ax_eval.set(title="held-out loss", xlabel="step", ylabel="loss", yscale="log")
    ax_lr.set(title="learning rate per rank", xlabel="step", ylabel="lr")
    ax_lr.set_ylim(bottom=0)
    for ax in (ax_eval, ax_lr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or run.name)
    return fig


def early_climb(run: Run, within: int) -> dict[str, Any]:
    """How far the loss (mean over ranks) rose above its value at step 0 during steps 1..within-1, and at which
    step it was highest (climb <= 0: it never went back above where it started)."""
    loss = run.steps().set_index("step")["loss"]
    early = loss.loc[1:within - 1]
    return {"start": float(loss.iloc[0]), "highest": float(early.max()), "at_step": int(early.idxmax()),
            "climb": float(early.max() - loss.iloc[0])}


def restart_steps(run: Run) -> list[int]:
    """Steps at which the LR went up after the warmup: the restarts of a cosine with hard restarts."""
    lr = run.steps().set_index("step")["lr"]
    after = lr.loc[run.config.warmup_steps:]
    return [int(s) for s in after.index[1:][after.values[1:] > after.values[:-1]]]


def tail_loss(run: Run, last: int = 5) -> float:
    """Mean loss over ranks of the last `last` steps. On tinylm every step draws new sentences, so this is a loss
    on text the model had not seen before that step."""
    return float(run.steps()["loss"].tail(last).mean())
