"""All-reduce every step, or not: synchronous DDP, local SGD (periodic model averaging) and Hogwild.

    from labkit import RunConfig, launch
    from labkit.tricks.averaging import LocalSGD, Hogwild, sync_ddp, shared_model, timeline, plot_timelines
    cfg = RunConfig(task="digits", world_size=2, optimizer="sgd", lr=0.05, steps=200, tensorboard=False)
    sync = launch(sync_ddp, config=cfg, name="sync")               # Horovod's recipe, in torch.distributed
    p4 = launch(LocalSGD(period=4), config=cfg, name="period 4")   # post-local SGD: average every 4 steps
    model = shared_model(cfg)                                       # one model, in shared memory, in this process
    hog = launch(Hogwild(model), config=cfg, name="hogwild", start_method="fork")  # no locks, no collectives
    timeline(p4)                                                    # per step: loss, samples_seen, wall_s, ...
    plot_timelines([sync, p4, hog])                                 # loss vs wall time | vs samples | divergence

Records per step and rank, besides loss, lr, samples and t_step (what labkit.compare draws):
    divergence_before  max over ranks r of ||params_r - params_0|| after this step's local update, before averaging
    divergence         the same, measured again once the step is complete (after averaging, if it averaged)
    averaged           1 when this rank all-reduced its parameters at this step (seen by the collective counter)
    allreduces, comm_bytes   collectives this rank issued with other ranks this step (gradients, parameters) and
                       the bytes of the tensors handed to them, counted at torch.distributed (train.commhooks)
    t_step             the step's own work: data, forward/backward (with DDP's all-reduce), optimizer, averaging.
                       The divergence measurements (all_gathers) are timed apart, as t_measure, and neither timed
                       nor counted with the method.
"""
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd
import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel as DDP

from ..measure import Bound, below
from ..records import Run, per_step
from ..training.commhooks import count_collectives
from ..training.loop import NonFiniteLoss
from ..training.optim import make_optimizer
from ..training.lr import lr_for_config
from ..training.seeding import seed_everything
from ..training.tasks import make_task
from ..view import COLORS, new_figure, shown

# No `from __future__ import annotations` here: DDP inspects a comm hook's annotations and wants real types.


def averages_at(step: int, period: int, warmup: int = 0) -> bool:
    """Whether PeriodicModelAverager averages at loop step `step` (0-based):  averages_at(8, period=4) -> True.

    Its rule: from `warmup` on, every `period`-th call, starting with the call at `warmup` itself."""
    return step >= warmup and (step - warmup) % period == 0


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All parameters in one 1-D float tensor (a copy):  flat_parameters(model).numel()."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def rank_divergence(model: nn.Module, group: Any = None) -> float:
    """How far apart the ranks' copies are:  rank_divergence(model) -> max_r ||params_r - params_0||.

    A collective (all_gather of every parameter): every rank of `group` must call it; all get the same number.
    0.0 exactly when every rank holds the same bits."""
    flat = flat_parameters(model)
    world = dist.get_world_size(group)
    if world == 1:
        return 0.0
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype)
    dist.all_gather_into_tensor(gathered, flat, group=group)
    rows = gathered.view(world, -1)
    return (rows[1:] - rows[0]).norm(dim=1).max().item()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int = 0) -> None:
    """Give every rank rank `src`'s optimizer state (Horovod's broadcast_optimizer_state):
    broadcast_optimizer_state(opt). Matters when rank 0 resumed from a checkpoint and the others did not."""
    state = [optimizer.state_dict() if dist.get_rank() == src else None]
    dist.broadcast_object_list(state, src=src)
    if dist.get_rank() != src:
        optimizer.load_state_dict(state[0])


def _setup(ctx: Any, config: Any) -> tuple[Any, nn.Module, DDP, torch.optim.Optimizer]:
    """Task, model, DDP and optimizer, the Horovod recipe's set-up in torch.distributed terms."""
    if config.grad_accum != 1:
        raise ValueError(f"grad_accum = {config.grad_accum}: the averaging loops take one batch per step; use 1")
    # hvd.init(): labkit.launch has called dist.init_process_group; ctx.rank and ctx.world_size are hvd.rank/size.
    # hvd.local_rank() + torch.cuda.set_device(...): ctx.local_rank; launch sets the device when it picks nccl.
    seed_everything(config.seed)
    task = make_task(config, ctx.world_size)
    model = task.build_model().to(ctx.device)
    seed_everything(config.seed, rank=ctx.rank)
    # hvd.broadcast_parameters(model.state_dict(), root_rank=0): DDP's constructor broadcasts rank 0's.
    # hvd.DistributedOptimizer(opt): DDP all-reduces and averages the gradients during backward.
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = make_optimizer(config, model.parameters())
    broadcast_optimizer_state(optimizer)  # hvd.broadcast_optimizer_state(opt, root_rank=0)
    return task, model, ddp, optimizer


def _communication(ddp: DDP, period: int | None, warmup: int) -> PeriodicModelAverager | None:
    """Sync: DDP's plain all-reduce, as torch's Python allreduce_hook (DDP's built-in one runs in C++, where the
    collective counter cannot see it). Local SGD: the post-local SGD hook and a PeriodicModelAverager."""
    if period is None:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return None
    # Each rank its own subgroup: after `warmup` steps, gradients are "all-reduced" within it (with itself),
    # which is no communication at all. subgroup=None means one subgroup per machine, sized by the number of
    # CUDA devices: it fails on a CPU-only machine.
    subgroup, _ = dist.new_subgroups(group_size=1)
    state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=warmup)
    ddp.register_comm_hook(state, post_localSGD_hook)
    return PeriodicModelAverager(period=period, warmup_steps=warmup)


def _local_update(task: Any, ddp: DDP, optimizer: torch.optim.Optimizer, ctx: Any, step: int, lr: float) -> float:
    """Forward, backward (DDP's hook runs here) and the optimizer step on this rank's batch; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    inputs, targets = (t.to(ctx.device) for t in task.batch(step, 0, ctx.rank))
    loss, _ = task.loss(ddp, inputs, targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def _train(ctx: Any, config: Any, period: int | None, warmup: int) -> dict[str, float]:
    """The loop behind sync_ddp (period None) and LocalSGD; returns what _finish measures."""
    task, model, ddp, optimizer = _setup(ctx, config)
    averager = _communication(ddp, period, warmup)
    with count_collectives() as wire:
        for step in range(config.steps):
            ctx.heartbeat(step)
            lr = lr_for_config(step, config)
            t0 = time.perf_counter()
            loss = _local_update(task, ddp, optimizer, ctx, step, lr)
            t1 = time.perf_counter()
            with wire.paused():  # a measurement, not part of the method: timed apart and not counted
                before = rank_divergence(model)
            t2 = time.perf_counter()
            grad_calls, grad_bytes = wire.take()
            if averager is not None:
                averager.average_parameters(model.parameters())  # before zero_grad: it averages only params with .grad
            param_calls, param_bytes = wire.take()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            with wire.paused():
                after = rank_divergence(model)
            ctx.record(step, loss=loss, lr=lr, samples=task.batch_size, t_step=(t1 - t0) + (t3 - t2),
                       t_measure=(t2 - t1) + (time.perf_counter() - t3), divergence_before=before, divergence=after,
                       averaged=int(param_calls > 0), allreduces=grad_calls + param_calls,
                       comm_bytes=grad_bytes + param_bytes)
    return _finish(task, model, last_loss=loss, local=averager is not None)


def _finish(task: Any, model: nn.Module, last_loss: float, local: bool) -> dict[str, float]:
    """What a run ends with: divergence at the end, the last step's global loss, held-out metrics of the model
    kept. Local SGD keeps the ranks' mean model (one last average); synchronous ranks hold it already."""
    final_divergence = rank_divergence(model)
    if local:
        average_parameters(iter(model.parameters()), dist.group.WORLD)
    return {"final_divergence": final_divergence, "final_loss": mean_over_ranks(last_loss), **task.evaluate(model)}


def mean_over_ranks(value: float) -> float:
    """The mean of `value` over all ranks, on every rank:  mean_over_ranks(loss.item()).

    Horovod's hvd.allreduce(metric, average=True) (hvd.allreduce(metric, op=hvd.Average) in newer versions)."""
    total = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


def sync_ddp(ctx: Any, config: Any = None) -> dict[str, float]:
    """Fully synchronous data parallel SGD, gradients all-reduced every step:  launch(sync_ddp, config=cfg).

    The same loop and records as LocalSGD. run.result(rank): final_divergence, final_loss (the last step's loss,
    all-reduced over ranks) and the task's held-out metrics (digits: eval_accuracy)."""
    return _train(ctx, config or ctx.config, period=None, warmup=0)


@dataclass(frozen=True)
class LocalSGD:
    """Post-local SGD: launch(LocalSGD(period=4, warmup=0), config=cfg).

    Synchronous DDP for `warmup` steps, then every rank steps on its own gradients, and PeriodicModelAverager
    all-reduces the parameters (their mean) every `period` steps (torch.distributed.algorithms.model_averaging)."""

    period: int
    warmup: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.period, int) and self.period >= 1):
            raise ValueError(f"period = {self.period!r}: must be an integer >= 1 (steps between averagings)")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise ValueError(f"warmup = {self.warmup!r}: must be an integer >= 0 (synchronous steps first)")

    def __call__(self, ctx: Any) -> dict[str, float]:
        return _train(ctx, ctx.config, period=self.period, warmup=self.warmup)


def shared_model(config: Any) -> nn.Module:
    """The task's model, seeded, with its parameters in shared memory:  model = shared_model(cfg).

    Build it in the launching process; ranks forked afterwards (launch(..., start_method="fork")) map the same
    memory, so a write by any of them is seen by all, and by this process."""
    seed_everything(config.seed)
    return make_task(config, 1).build_model().share_memory()


@dataclass(frozen=True)
class Hogwild:
    """Lock-free asynchronous SGD on one shared model:  launch(Hogwild(model), config=cfg, start_method="fork").

    Every rank reads the shared parameters, computes a gradient on its own batch and writes its update in place,
    with no lock and no collective: it may read parameters another rank is halfway through updating. Each rank
    keeps its own optimizer state (momentum). The process group launch creates goes unused."""

    model: nn.Module

    def __call__(self, ctx: Any) -> dict[str, float]:
        if not all(p.is_shared() for p in self.model.parameters()):
            raise RuntimeError("Hogwild: the model's parameters are not in shared memory in this rank; build it with "
                               "shared_model(cfg) and launch with start_method='fork' (spawn copies it)")
        config = ctx.config
        seed_everything(config.seed, rank=ctx.rank)
        task = make_task(config, ctx.world_size)
        optimizer = make_optimizer(config, self.model.parameters())
        with count_collectives() as wire:  # none are issued: counted all the same, so the records say so
            for step in range(config.steps):
                ctx.heartbeat(step)
                lr = lr_for_config(step, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                t0 = time.perf_counter()
                inputs, targets = task.batch(step, 0, ctx.rank)
                loss, _ = task.loss(self.model, inputs, targets)
                loss.backward()
                optimizer.step()  # in place, into the shared storage
                optimizer.zero_grad(set_to_none=True)
                calls, sent = wire.take()
                ctx.record(step, loss=loss.item(), lr=lr, samples=task.batch_size, t_step=time.perf_counter() - t0,
                           allreduces=calls, comm_bytes=sent)
                if config.nan_policy != "ignore" and not math.isfinite(loss.item()):  # no collectives to agree over
                    raise NonFiniteLoss(f"loss is {loss.item()} at step {step} on rank {ctx.rank}: Hogwild "
                                        "diverged; lower the LR")
        return task.evaluate(self.model)


def timeline(run: Run) -> pd.DataFrame:
    """One row per step:  timeline(run)[["step", "loss", "samples_seen", "wall_s", "divergence"]].

    wall_s: when the slowest rank had finished this step, counting each rank's own t_step (so the divergence
    measurement and the writing of records are left out, and ranks that do not step together, as in Hogwild, are
    not charged for each other). divergence*, averaged, allreduces and comm_bytes come from rank 0."""
    df = run.read_records()
    out = per_step(df)
    own = df.sort_values("step").groupby("rank")["t_step"].cumsum()
    out["wall_s"] = own.groupby(df["step"]).max().sort_index().to_numpy()
    rank0 = df[df["rank"] == 0].set_index("step")
    for column in ("divergence_before", "divergence", "averaged", "allreduces", "comm_bytes"):
        if column in rank0:
            out[column] = rank0[column].reindex(out["step"]).to_numpy()
    return out



# The lesson's claims about one local-SGD run, each a function of timeline(run) that returns (measured, holds).

def schedule_check(t: pd.DataFrame, period: int, steps: int) -> tuple[list[int], bool]:
    """The steps that sent bytes, and whether the ranks met again (divergence 0) at exactly those steps and they are
    PeriodicModelAverager's:  sent, ok = schedule_check(timeline(run), period=4, steps=128)."""
    planned = [s for s in range(steps) if averages_at(s, period)]
    sent = t.loc[t["comm_bytes"] > 0, "step"].tolist()                                   # counted, as issued
    met = t.loc[(t["divergence"] == 0.0) & (t["divergence_before"] > 0), "step"].tolist()  # measured
    return sent, sent == met == planned and len(planned) == math.ceil(steps / period)


def ranks_sent_alike(run: Run) -> tuple[int, bool]:
    """Steps recorded, and whether every rank issued the same collectives and bytes at each:  ranks_sent_alike(run)."""
    per_step = run.read_records().groupby("step")[["allreduces", "comm_bytes"]].nunique()
    return len(per_step), bool(per_step.eq(1).all().all())


def one_all_reduce_per_averaging(t: pd.DataFrame, period: int, n_params: int) -> tuple[str, bool]:
    """Whether each averaging step issued one collective of every fp32 parameter:
    one_all_reduce_per_averaging(timeline(run), 4, n_params)."""
    at = t[[averages_at(s, period) for s in t["step"]]]
    shown = f"{at['allreduces'].max()} collective(s), {at['comm_bytes'].max()} bytes"
    return shown, bool((at["allreduces"] == 1).all() and (at["comm_bytes"] == n_params * 4).all())


def apart_between_averagings(t: pd.DataFrame, period: int) -> tuple[float, bool]:
    """The smallest divergence at a step that did not average, and whether it is above 0 at every such step."""
    off = t.loc[[not averages_at(s, period) for s in t["step"]], "divergence"]
    return (float(off.min()) if len(off) else float("nan")), bool((off > 0).all())


def divergence_grows_in_a_period(t: pd.DataFrame, period: int) -> tuple[list[float], bool | Bound]:
    """Mean divergence one step after an averaging, halfway through a period, and on its last step, and whether it
    grows in that order:  divergence_grows_in_a_period(timeline(run), 16)."""
    profile = t.groupby(t["step"] % period)["divergence"].mean()
    points = [float(profile[1]), float(profile[period // 2]), float(profile[period - 1])]
    grows = points[1] > 0 and points[2] > 0 and below(max(points[0] / points[1], points[1] / points[2]), 1,
                                                      "distance, each point / the next (the larger)")
    return [round(p, 4) for p in points], grows   # distances are >= 0: the same as p0 < p1 < p2

@shown
def plot_timelines(runs: Sequence[Run], labels: Sequence[str] | None = None, title: str | None = None, *,
                   smooth: int = 1, divergence_steps: int | None = None) -> Figure:
    """Loss vs wall time | loss vs samples seen | divergence between ranks vs step:  plot_timelines([a, b]).

    smooth: plot the loss as a running mean over this many steps. divergence_steps: show only the first steps of
    the divergence (its sawtooth is unreadable over hundreds of steps)."""
    fig = new_figure(figsize=(16, 4.4))
    ax_wall, ax_samples, ax_div = fig.subplots(1, 3)
    for run, label, color in zip(runs, labels or [r.name for r in runs], COLORS * 4):
        t = timeline(run)
        loss = t["loss"].rolling(smooth, min_periods=1).mean()
        ax_wall.plot(t["wall_s"], loss, color=color, label=label)
        ax_samples.plot(t["samples_seen"], loss, color=color, label=label)
        if "divergence_before" in t:
            shown = t if divergence_steps is None else t[t["step"] < divergence_steps]
            ax_div.plot(shown["step"], shown["divergence_before"], color=color, label=label)
    suffix = f" (running mean of {smooth} steps)" if smooth > 1 else ""
    ax_wall.set(title="loss vs wall time" + suffix, xlabel="seconds of step work (slowest rank)", ylabel="loss")
    ax_samples.set(title="loss vs samples seen" + suffix, xlabel="global samples seen", ylabel="loss")
    ax_div.set(title="divergence before averaging: max_r ||params_r - params_0||", xlabel="step", ylabel="L2 norm")
    for ax in (ax_wall, ax_samples, ax_div):
        ax.grid(alpha=0.3)
    ax_samples.legend(fontsize=8)
    ax_div.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig
