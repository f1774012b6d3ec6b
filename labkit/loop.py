"""The instrumented DDP training loop: `train(ctx, config)` runs on every rank.

    run = labkit.launch(RunConfig(world_size=2, steps=20))     # launch calls train(ctx, cfg) on each rank
    torchrun --nproc-per-node 2 -m labkit run config.json      # the same loop under torchrun

Per step and rank it records (records.py has the file layout):
    loss        this rank's loss (mean over its micro-batches)
    loss_mean   the loss averaged over all ranks (an all-reduce issued asynchronously, overlapping the optimizer)
    lr, grad_norm (before clipping), samples and tokens this rank processed
    t_data, t_fwd_bwd (includes DDP's all-reduce of gradients, overlapped with backward), t_optim,
    t_step      wall time since the previous step ended (so it includes writing the previous record)
    rss_mb      resident memory of the rank; cuda_peak_mb on GPUs
    accuracy / eval_accuracy on tasks that have them
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .faults import inject, nan_factor
from .schedule import lr_for_config
from .tasks import Task, make_task


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite (RunConfig.stop_on_nan)."""


def train(ctx: Any, config: Any = None) -> None:
    """Train config.task with DDP on this rank, recording every step through ctx.record."""
    config = config or ctx.config
    if config is None:
        raise ValueError("train needs a RunConfig: launch(RunConfig(...)) or launch(train, config=cfg)")
    torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    task = make_task(config, ctx.world_size)
    model = task.build_model().to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
              bucket_cap_mb=config.bucket_cap_mb)
    optimizer = make_optimizer(config, model.parameters())
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=config.precision == "fp16")
    step_started = time.perf_counter()
    for step in range(config.steps):
        ctx.heartbeat(step)
        inject(config.faults, ctx.rank, step)
        lr = lr_for_config(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, extras, t_data, t_fwd_bwd = _forward_backward(ddp, task, ctx, config, scaler, step)
        loss_sum = torch.tensor([loss], dtype=torch.float64, device=ctx.device)
        pending = dist.all_reduce(loss_sum, async_op=True)  # overlaps the optimizer step below
        t0 = time.perf_counter()
        grad_norm = _optimizer_step(model, optimizer, scaler, config.clip_norm)
        t_optim = _elapsed(t0, ctx.device)
        pending.wait()
        if config.eval_every and ((step + 1) % config.eval_every == 0 or step == config.steps - 1):
            extras.update(task.evaluate(model))
        now = time.perf_counter()
        ctx.record(step, loss=loss, loss_mean=loss_sum.item() / ctx.world_size, lr=lr, grad_norm=grad_norm,
                   samples=task.batch_size * config.grad_accum,
                   tokens=task.batch_size * config.grad_accum * task.tokens_per_sample,
                   t_data=t_data, t_fwd_bwd=t_fwd_bwd, t_optim=t_optim, t_step=now - step_started,
                   **memory_fields(ctx.device), **extras)
        step_started = now
        if config.stop_on_nan and not math.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss} at step {step} on rank {ctx.rank}; "
                                "lower the LR, clip gradients (clip_norm) or warm up")
    if config.save_final:
        (ctx.run_dir / "final").mkdir(exist_ok=True)
        torch.save(model.state_dict(), ctx.run_dir / "final" / f"rank{ctx.rank}.pt")


def _forward_backward(ddp: DDP, task: Task, ctx: Any, config: Any, scaler: Any,
                      step: int) -> tuple[float, dict, float, float]:
    """All micro-batches of one step; DDP all-reduces gradients only on the last one (no_sync before it)."""
    loss_total, extras, t_data, t_fwd_bwd = 0.0, {}, 0.0, 0.0
    for micro in range(config.grad_accum):
        t0 = time.perf_counter()
        inputs, targets = (t.to(ctx.device, non_blocking=True) for t in task.batch(step, micro, ctx.rank))
        t1 = time.perf_counter()
        last = micro == config.grad_accum - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()), autocast(config.precision, ctx.device):
            loss, extras = task.loss(ddp, inputs, targets)
            loss = loss * nan_factor(config.faults, ctx.rank, step)
        scaler.scale(loss / config.grad_accum).backward()
        t_data += t1 - t0
        t_fwd_bwd += _elapsed(t1, ctx.device)
        loss_total += loss.item() / config.grad_accum
    return loss_total, extras, t_data, t_fwd_bwd


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                    clip_norm: float | None) -> float:
    """Unscale, measure (and maybe clip) the gradient norm, step, zero; returns the norm before clipping."""
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()


def make_optimizer(config: Any, params: Any) -> torch.optim.Optimizer:
    """The optimizer named by config.optimizer, at config.lr (the schedule changes it every step)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Mixed-precision context for fp16/bf16; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def memory_fields(device: torch.device) -> dict[str, float]:
    """rss_mb (this process) and, on CUDA, cuda_peak_mb (peak allocated since the start)."""
    fields = {"rss_mb": _rss_bytes() / 2**20}
    if device.type == "cuda":
        fields["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return fields


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:  # cheap: one small read, no psutil object per step
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _elapsed(t0: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU work is asynchronous: time it only once it is done
    return time.perf_counter() - t0
