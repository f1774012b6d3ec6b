"""Learning-rate schedules (lesson 10): the LR the ranks recorded against the schedule's own function, the
ranks' agreement, warmup's effect on an early spike, and restarts.

    from labkit.tricks import schedules
    schedules.reference_lrs(cfg)          # transformers' own scheduler, stepped as a training loop steps it
    schedules.torch_lrs(cfg)              # labkit's own schedules rebuilt from torch's schedulers, chained
    schedules.cosine_with_warmup_lrs(cfg) # transformers' get_cosine_schedule_with_warmup, stepped the same way
    schedules.lr_mismatch(run)            # largest |recorded LR - schedule's LR| over every step and rank
    schedules.lr_mismatch(run, schedules.torch_lrs(run.config))   # ... against another reference
    run.lr_disagreement()                 # the first step where the ranks' LRs differ (labkit.records)
    schedules.rank_lrs(run)               # figure: each rank's held-out loss and LR (the per-rank plateau bug)
    schedules.early_climb(run, within=10) # how far the loss climbed back above its first value, and when
    schedules.restart_steps(run)          # steps at which the LR jumped back up
    schedules.expected_restarts(cfg)      # ... and where transformers' schedule puts those jumps
    schedules.cut_steps(run)              # steps at which the LR went down (a plateau's cuts)
    schedules.first_step_at(run, 0.1)     # first step at which every rank trained at that LR (warmup's end)
    schedules.loss_gap(hard, plain, until=10)   # largest |loss difference| of two runs over steps 0..until
    schedules.restart_rises(hard, plain)  # per restart: how much the loss rose against plain cosine, same steps
    schedules.tail_loss(run, last=5)      # mean loss of the last steps
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import torch
from matplotlib.figure import Figure

from ..config import RunConfig
from ..records import Run
from ..training.lr import TRANSFORMERS, lr_for_config
from ..view import COLORS, new_figure, shown

LR_TOLERANCE = 1e-12  # relative: two computations of one schedule in float64 agree to rounding, far below this


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
    return _stepped(optimizer, scheduler, config.steps)


def _stepped(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
    """The LR of each of `steps` optimizer steps, the scheduler driven the usual way: read, step, scheduler.step()."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def torch_lrs(config: RunConfig) -> list[float]:
    """labkit's own schedules ("constant", "linear", "cosine") rebuilt from torch.optim.lr_scheduler, an
    implementation independent of labkit's lr_at, chained to labkit's conventions: LinearLR from peak/warmup at
    step 0 to the peak at step warmup-1 (labkit's warmup trains at step 0), then, from step warmup on,
    CosineAnnealingLR or LinearLR reaching the floor (min_lr_ratio * peak) on the last step, or a constant LR."""
    if config.schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"schedule = {config.schedule!r}: torch_lrs rebuilds labkit's own schedules (constant, "
                         "linear, cosine); transformers' have reference_lrs")
    import warnings
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    warm, decay = config.warmup_steps, max(config.steps - config.warmup_steps - 1, 1)
    if config.schedule == "cosine":
        after = CosineAnnealingLR(optimizer, T_max=decay, eta_min=config.lr * config.min_lr_ratio)
    elif config.schedule == "linear":
        after = LinearLR(optimizer, start_factor=1.0, end_factor=config.min_lr_ratio, total_iters=decay)
    else:
        after = ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warm:
        ramp = LinearLR(optimizer, start_factor=1 / warm, end_factor=1.0, total_iters=warm - 1) if warm > 1 \
            else ConstantLR(optimizer, factor=1.0, total_iters=0)
        with warnings.catch_warnings():  # SequentialLR steps its schedulers at construction; torch warns of it
            warnings.simplefilter("ignore")
            scheduler = SequentialLR(optimizer, [ramp, after], milestones=[warm])
    else:
        scheduler = after
    return _stepped(optimizer, scheduler, config.steps)


def cosine_with_warmup_lrs(config: RunConfig) -> list[float]:
    """transformers' get_cosine_schedule_with_warmup (no restarts) for config's peak, warmup and steps, driven as
    a training loop drives it: what "cosine_restarts" with cycles=1 should be."""
    from transformers import get_cosine_schedule_with_warmup
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    return _stepped(optimizer, get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.steps),
                    config.steps)


def lr_mismatch(run: Run, reference: list[float] | None = None) -> float:
    """The largest |recorded LR - reference| over every step and rank, relative to the run's peak LR (0.0: equal
    everywhere); reference: one LR per step, default reference_lrs(run.config)."""
    df = run.read_records()
    expected = pd.Series(reference_lrs(run.config) if reference is None else reference)
    return float((df["lr"] - df["step"].map(expected)).abs().max() / run.config.lr)


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


def expected_restarts(config: RunConfig) -> list[int]:
    """The steps after the warmup at which the schedule's own LRs (reference_lrs) jump back up: where transformers
    puts the restarts of config's cosine with hard restarts."""
    lrs = reference_lrs(config)
    return [s for s in range(config.warmup_steps + 1, config.steps) if lrs[s] > lrs[s - 1]]


def cut_steps(run: Run) -> list[int]:
    """Steps at which rank 0's recorded LR went down from the step before: a plateau scheduler's cuts."""
    df = run.read_records()
    lr = df[df["rank"] == 0].set_index("step")["lr"].sort_index()
    return [int(s) for s in lr.index[1:][lr.values[1:] < lr.values[:-1]]]


def first_step_at(run: Run, lr: float, rel: float = 1e-9) -> int | None:
    """The first step at which every rank recorded `lr` (to a relative `rel`): where a warmup reached its peak.
    None if no step did."""
    df = run.read_records()
    hit = df.groupby("step")["lr"].apply(lambda lrs: bool(((lrs - lr).abs() <= rel * abs(lr)).all()))
    return int(hit.index[hit][0]) if hit.any() else None


def loss_gap(a: Run, b: Run, until: int) -> float:
    """The largest |loss of a - loss of b| (mean over ranks) over steps 0..until: 0.0 while two runs are one run."""
    gap = a.steps().set_index("step")["loss"] - b.steps().set_index("step")["loss"]
    return float(gap.loc[:until].abs().max())


def restart_rises(hard: Run, plain: Run, within: int = 5) -> list[float]:
    """Per restart of `hard` (restart_steps): how much more its loss exceeds `plain`'s over the `within` steps from
    the restart than over the `within` steps before it. Both runs train on the same batches at the same step (same
    seed), so the difference between their losses at a step leaves out how hard that step's batch was; a rise > 0
    says the restart cost progress against the run that did not restart."""
    gap = hard.steps().set_index("step")["loss"] - plain.steps().set_index("step")["loss"]
    return [float(gap.loc[r:r + within - 1].mean() - gap.loc[r - within:r - 1].mean()) for r in restart_steps(hard)]


def tail_loss(run: Run, last: int = 5) -> float:
    """Mean loss over ranks of the last `last` steps. On tinylm every step draws new sentences, so this is a loss
    on text the model had not seen before that step."""
    return float(run.steps()["loss"].tail(last).mean())
