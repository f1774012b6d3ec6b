"""The folklore recipe `try: step() except Exception: continue` around a distributed step, run for real (lesson 13).

    labkit.launch(recipe(fails="data"), world_size=2, timeout=3)      # -> RankFailure: a hang, ended by the watchdog
    drift = labkit.launch(recipe(fails="optimizer"), world_size=2)    # finishes
    divergence(drift)                                   # per step: max |rank 1's parameters - rank 0's|

Rank 1 raises once, at `bad_step`, inside the guarded block; the recipe swallows the exception and goes on with
the next step. Where it raises decides what goes wrong:
- fails="data" (a corrupt sample, before forward): rank 1 skips that step's backward, so it issues one all-reduce
  fewer than rank 0. Collectives pair up by their order, not by their step: from then on rank 1's all-reduces are
  summed with rank 0's previous ones, and at the end rank 0 waits in an all-reduce that rank 1 never issues (rank 1
  waits in the end-of-training barrier). A hang: only a watchdog ends it.
- fails="optimizer" (after backward, before optimizer.step: a logging call or a check that raises): the all-reduce
  happened, so nothing hangs, but rank 1 misses one update. DDP compares parameters only when it is built, so from
  then on the ranks train two different models on the same averaged gradients, and nothing says so.

The observer (a copy of each rank's parameters after every step, saved before the final barrier) is the lesson's,
not the recipe's: it issues no collective, so it changes nothing the ranks do.
"""
from __future__ import annotations

import functools
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..records import Run
from ..training.tasks import make_task, preload
from ..view import COLORS, new_figure, shown

FAILS = ("data", "optimizer")
# Hand it to launch(recipe(...), config=DIGITS): ranks then start with the digits data (and scikit-learn) loaded
# wherever they are forked from, the kernel or labkit's warm process. Without it a rank forked from the warm process
# imports scikit-learn itself, seconds on a busy machine, which a short watchdog reads as a hang before step 0.
DIGITS = RunConfig(task="digits", world_size=2, global_batch=64, tensorboard=False, save_final=False)


def recipe(*, fails: str = "data", bad_step: int = 3, steps: int = 10) -> Any:
    """swallowing_loop with these settings, as a function to launch; the digits data are loaded here first, so
    that forked ranks do not spend a short watchdog's seconds importing scikit-learn."""
    if fails not in FAILS:
        raise ValueError(f"fails = {fails!r}: must be one of {', '.join(FAILS)}")
    preload(RunConfig(task="digits"))
    return functools.partial(swallowing_loop, fails=fails, bad_step=bad_step, steps=steps)


def swallowing_loop(ctx: Any, *, fails: str = "data", bad_step: int = 3, steps: int = 10) -> None:
    """A DDP loop on digits whose step is wrapped in the recipe; rank 1 raises once at `bad_step` (see above)."""
    if fails not in FAILS:
        raise ValueError(f"fails = {fails!r}: must be one of {', '.join(FAILS)}")
    torch.manual_seed(0)
    config = RunConfig(task="digits", world_size=ctx.world_size, global_batch=32 * ctx.world_size)
    task = make_task(config, ctx.world_size)
    model = task.build_model()
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    snapshots = []
    for step in range(steps):
        ctx.heartbeat(step)
        try:
            inputs, targets = task.batch(step, 0, ctx.rank)
            if ctx.rank == 1 and step == bad_step and fails == "data":
                raise ValueError(f"corrupt sample in step {step}'s batch")
            loss, _ = task.loss(ddp, inputs, targets)
            loss.backward()
            if ctx.rank == 1 and step == bad_step and fails == "optimizer":
                raise RuntimeError(f"a metric failed to log at step {step}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except Exception as exc:  # noqa: BLE001 - the recipe under test
            print(f"rank {ctx.rank}, step {step}: swallowed {exc!r}; continuing with the next step")
            optimizer.zero_grad(set_to_none=True)
            snapshots.append(_flat(model))
            continue
        ctx.record(step, loss=loss.item())
        snapshots.append(_flat(model))
    torch.save(torch.stack(snapshots), ctx.run_dir / f"params{ctx.rank}.pt")
    dist.barrier()  # the end of training: everyone waits here before saving a model


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def divergence(run: Run) -> pd.Series:
    """Per step, the largest |parameter on rank r - the same parameter on rank 0| over all parameters and ranks."""
    params = [torch.load(run.path / f"params{r}.pt", weights_only=True) for r in range(run.world_size)]
    steps = min(len(p) for p in params)
    gap = torch.stack([(p[:steps] - params[0][:steps]).abs().amax(dim=1) for p in params]).amax(dim=0)
    return pd.Series(gap.tolist(), index=pd.RangeIndex(steps, name="step"), name="max_param_diff")


@shown
def divergence_figure(run: Run, bad_step: int) -> Figure:
    """Each rank's loss | how far the ranks' parameters are apart, per step (log scale; 0 on the bottom edge)."""
    fig = new_figure(figsize=(12, 4))
    ax_loss, ax_gap = fig.subplots(1, 2)
    for rank, rows in run.df.groupby("rank"):
        ax_loss.plot(rows["step"], rows["loss"], "o-", markersize=3, color=COLORS[int(rank)], label=f"rank {rank}")
    gap = divergence(run)
    floor = 1e-9
    ax_gap.plot(gap.index, gap.clip(lower=floor), "o-", color="tab:red", markersize=3)
    for ax in (ax_loss, ax_gap):
        ax.axvline(bad_step, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_loss.set(ylabel="loss", title="each rank's loss (rank 1 records no loss at the swallowed step)")
    ax_loss.legend(fontsize=8)
    ax_gap.set(yscale="log", ylim=(floor / 3, None), ylabel="max |rank 1 - rank 0|",
               title=f"parameters apart (equal: plotted at {floor:g}); dotted: the swallowed step")
    return fig
