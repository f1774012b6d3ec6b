"""The instrumented DDP training loop: `train(ctx, config)` runs on every rank.

    run = labkit.launch(RunConfig(world_size=2, steps=20))     # launch calls train(ctx, cfg) on each rank
    torchrun --nproc-per-node 2 -m labkit run config.json      # the same loop under torchrun

Per step and rank it records (records.py has the file layout):
    loss        this rank's loss (mean over its micro-batches); Run.steps() averages it over ranks, which is
                exactly the global loss (equal batches per rank) without an extra all-reduce per step
    lr, grad_norm (before clipping), clip_coef (the norm clipping left / grad_norm: 1.0 where it did not act),
                samples and tokens this rank processed (rows of the inputs it ran)
    t_data, t_fwd_bwd (includes DDP's all-reduce of gradients, overlapped with backward), t_optim (includes
                the nan_policy flag's all-reduce under "stop"/"skip"),
    t_step      wall time since the previous step ended (so it includes writing the previous record)
    allreduces, comm_bytes   collectives this rank issued this step (DDP's comm hook: RunConfig.comm_hook; the
                nan_policy flag; the plateau's held-out loss) and the bytes of the tensors handed to them, counted
                at torch.distributed (commhooks.py)
    loss_scale, skipped_step   what the loss was multiplied by before backward (GradScaler under fp16, else 1.0);
                1 when the optimizer did not step (GradScaler found an inf/NaN gradient, or nan_policy "skip"/"stop"
                held it back), counted by a hook (amp.py)
    nonfinite_ranks   nan_policy "stop"/"skip": how many ranks' loss or gradients were not finite (nonfinite.py)
    rss_mb      resident memory of the rank; peak_growth_mb its peak above the level before the first step
                (RunConfig.memory_budget_mb turns it into an out-of-memory error); cuda_peak_mb on GPUs
    param_bytes, grad_bytes, optim_bytes, peak_param_bytes, act_bytes   memory this rank holds (held.py), on the
                first strategies.COUNTED_STEPS steps; there, strategies other than "ddp" also count collectives by
                kind (n_all_reduce, n_all_gather, ...), and leave allreduces / comm_bytes empty after (parallel/strategies.py)
    accuracy / eval_accuracy on tasks that have them; eval_loss, eval_loss_rank under schedule="plateau"
    model_params, model_params_active, model_params_embedding, model_layers, model_hidden, model_seq_len   on
                each rank's first record: the model's parameter counts and shape, what MFU needs (Task.model_fields;
                Run.model(), Run.mfu())
    cp_bytes, cp_pairs, cp_scores, cp_blocks_skipped   context_parallel > 1: bytes this rank sent in forward for
                attention, the (query, key) pairs the causal mask let it see, the scores it computed (its work),
                blocks the mask hid whole (parallel/context_model.py)
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from ..rundir import RunDir
from .amp import StepCounter, autocast
from .inject import clock_ahead, corrupt_batch, inject, nan_factor
from .plateau import Plateau
from .state.resume import Recovery
from .lr import lr_for_config
from .seeding import seed_everything, set_deterministic
from .nonfinite import NanGuard, NonFiniteLoss, optimizer_step
from .parallel.strategies import distribute
from .tasks import Task, make_task
from ..config import RunConfig
from ..context import RankContext

__all__ = ["train", "memory_fields", "NonFiniteLoss", "OutOfMemoryBudget"]


class OutOfMemoryBudget(MemoryError):
    """A step needed more memory than RunConfig.memory_budget_mb (or the GPU has): the per-rank batch is too big."""


def train(ctx: RankContext, config: RunConfig | None = None) -> None:
    """Train config.task on this rank, spread as config.strategy says (DDP by default), recording every step."""
    config = config or ctx.config
    if config is None:
        raise ValueError("train needs a RunConfig: launch(RunConfig(...)) or launch(train, config=cfg)")
    if config.deterministic:
        set_deterministic(True)
    seed_everything(config.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    task = make_task(config, ctx.world_size)
    model = task.build_model().to(ctx.device)
    counts = task.model_fields(model)  # the whole model's, before it is spread over ranks: with the first record
    seed_everything(config.seed, rank=ctx.rank)  # from here on (dropout, augmentation): a stream per rank
    placed = distribute(model, task, config, ctx)  # RunConfig.strategy: DDP, ZeRO, FSDP, TP
    ddp, optimizer, task = placed.model, placed.optimizer, placed.task
    model = placed.owned if placed.owned is not None else model  # a pipeline rank trains its stages only
    if config.precision == "fp8" or config.fp8_dispatch:  # switch layers (and the dispatch) in place, after DDP
        from .fp8_layers import apply_fp8
        apply_fp8(model, config)
    forward_backward = placed.forward_backward or _forward_backward
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=config.precision == "fp16")
    taken = StepCounter(optimizer)
    guard = NanGuard(config.nan_policy, model, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
                     check_gradients=not scaler.is_enabled())
    plateau = Plateau(config, task, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device) \
        if config.schedule == "plateau" else None
    recovery = Recovery(ctx, config, model, optimizer, scaler=scaler, plateau=plateau)
    task = recovery.resume(task)  # from the newest checkpoint in the run's directory, if it has one (resume.py)
    bad: list[int] = []
    baseline = _rss_bytes()
    step_started = time.perf_counter()
    with placed.counter() as wire:  # what this rank really hands to torch.distributed, step by step
        for step in range(recovery.start_step, config.steps):
            ctx.heartbeat(step)
            inject(config.faults, ctx.rank, step)
            lr = lr_for_config(step, config, peak=plateau.lr if plateau else None)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_scale, steps_before = scaler.get_scale(), taken.steps
            guard.start_step()
            with _profiled(config, step, ctx):  # RunConfig.profile_step: this step under torch.profiler
                with _reported_as_out_of_memory(config, step):
                    loss, extras, t_data, t_fwd_bwd, samples = forward_backward(ddp, task, ctx, config, scaler, step)
                t0 = time.perf_counter()
                bad = guard.agree(loss) if guard.agrees else []  # one small all-reduce: every rank decides alike
                norms = optimizer_step(model, optimizer, scaler, config.clip_norm, take=not bad)
                t_optim = _elapsed(t0, ctx.device)
            if config.eval_every and ((step + 1) % config.eval_every == 0 or step == config.steps - 1):
                extras.update(task.evaluate(model))
            if plateau and plateau.due(step):
                extras.update(plateau.evaluate(model))
            if guard.agrees:
                extras["nonfinite_ranks"] = len(bad)
            allreduces, comm_bytes = wire.take()
            memory = memory_fields(ctx.device, baseline)
            now = time.perf_counter()
            ahead = clock_ahead(config.faults, ctx.rank, step)  # a "clock" fault: this node's clock is off
            clock = {"time": time.time() + ahead} if ahead else {}
            ctx.record(step, loss=loss, lr=lr, **norms, **clock,
                       samples=placed.credit(samples), tokens=placed.credit(samples) * task.tokens_per_sample,
                       t_data=t_data, t_fwd_bwd=t_fwd_bwd, t_optim=t_optim, t_step=now - step_started,
                       allreduces=allreduces, comm_bytes=comm_bytes, loss_scale=loss_scale,
                       skipped_step=int(taken.steps == steps_before), **memory, **placed.fields(), **extras,
                       **(counts if step == recovery.start_step else {}))
            step_started = now
            _check_memory_budget(config, memory["peak_growth_mb"], step, task.batch_size)
            if guard.leaves(loss, step, bad):  # raises, or this rank stops here (nan_policy "alone" / "stop")
                break
            recovery.after_step(step)  # a checkpoint every config.checkpoint_every steps
    getattr(task, "close", lambda: None)()  # stop DataLoader workers after the last step, not inside it
    if guard.policy == "stop" and bad:
        return  # a peer raised the failure; the final parameters are not a finished run's
    guard.wait_for_peers()  # "alone": the end-of-training barrier the ranks still in their loop never reach
    if config.save_final:
        run_dir = RunDir(ctx.run_dir)
        run_dir.final.mkdir(exist_ok=True)
        torch.save(placed.full_state_dict(model), run_dir.final_params(ctx.rank))


def _forward_backward(ddp: Any, task: Task, ctx: RankContext, config: RunConfig, scaler: Any,
                      step: int) -> tuple[float, dict, float, float, int]:
    """All micro-batches of one step; DDP all-reduces gradients only on the last one (no_sync before it).
    Returns the loss, the task's extras, data and forward/backward seconds, and the samples that went through."""
    loss_total, extras, t_data, t_fwd_bwd, samples = 0.0, {}, 0.0, 0.0, 0
    for micro in range(config.grad_accum):
        t0 = time.perf_counter()
        inputs, targets = corrupt_batch(config.faults, ctx.rank, step, *task.batch(step, micro, ctx.rank))
        inputs, targets = inputs.to(ctx.device, non_blocking=True), targets.to(ctx.device, non_blocking=True)
        t1 = time.perf_counter()
        sync = micro == config.grad_accum - 1 or not config.no_sync
        with (contextlib.nullcontext() if sync else ddp.no_sync()), autocast(config.precision, ctx.device):
            loss, extras = task.loss(ddp, inputs, targets)
            loss = loss * nan_factor(config.faults, ctx.rank, step)
        scaler.scale(loss / config.grad_accum).backward()
        t_data += t1 - t0
        t_fwd_bwd += _elapsed(t1, ctx.device)
        loss_total += loss.item() / config.grad_accum
        samples += len(inputs)
    return loss_total, extras, t_data, t_fwd_bwd, samples




def _budget_advice(config: RunConfig, batch: int) -> str:
    return (f"per-rank batch {batch} is too large for this budget: accumulate instead, e.g. "
            f"RunConfig(grad_accum={config.grad_accum * 2}) keeps global_batch={config.global_batch} with half the "
            "samples in memory at once (or use more ranks)")


def _check_memory_budget(config: RunConfig, growth_mb: float, step: int, batch: int) -> None:
    if config.memory_budget_mb is not None and growth_mb > config.memory_budget_mb:
        raise OutOfMemoryBudget(f"step {step} needed {growth_mb:.0f} MB above the rank's starting memory; "
                                f"memory_budget_mb = {config.memory_budget_mb:g}. " + _budget_advice(config, batch))


@contextlib.contextmanager
def _profiled(config: RunConfig, step: int, ctx: RankContext) -> Any:
    """Step `config.profile_step` under torch.profiler, its Chrome trace written to the run directory on exit;
    every other step as it is (no profiler: its cost on every op would change what the records time)."""
    if step != config.profile_step:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as profiler:
        yield
    profiler.export_chrome_trace(str(RunDir(ctx.run_dir).trace(ctx.rank)))


@contextlib.contextmanager
def _reported_as_out_of_memory(config: RunConfig, step: int) -> Any:
    """A real CUDA out-of-memory error, re-raised with the same advice as the CPU budget."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        batch = config.global_batch // (config.world_size * config.grad_accum)
        raise OutOfMemoryBudget(f"CUDA out of memory at step {step}: {str(exc).splitlines()[0]} "
                                + _budget_advice(config, batch)) from exc


def memory_fields(device: torch.device, baseline: int = 0) -> dict[str, float]:
    """rss_mb (this process), peak_growth_mb (peak resident memory above `baseline` bytes) and, on CUDA,
    cuda_peak_mb (peak allocated since the start)."""
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes
    fields = {"rss_mb": _rss_bytes() / 2**20, "peak_growth_mb": max(0, peak - baseline) / 2**20}
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
