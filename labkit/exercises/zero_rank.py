"""Inside each rank: drive a learner's sharded optimizer through a few steps, watched, and keep what it did.

    outcome = drive_sharded(ctx, MyShardedOptimizer, torch.optim.AdamW, {"lr": 0.01}, steps=3)

Every rank builds the same CheckNet, computes the gradient of its rows, and the driver averages the gradients
itself (unwatched), so that only the optimizer is under test: ShardedOptimizer(model.parameters(), optimizer_cls,
**optimizer_kwargs).step() must then leave every rank with the parameters one process running optimizer_cls on
the whole batch has. The frozen parameter is passed in too (it has no gradient: no state, no update).
Before each step the driver sets the learning rate on the optimizer's param_groups as an LR scheduler would
(LR_SCHEDULE), so a step() that never passes param_groups' settings on to the optimizer that steps is caught.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .checknet import build_checknet, check_batch, check_loss, param_names, snapshot
from .ddp_rank import SEED, param_table
from .holdings import state_holdings
from .learner import learner_part
from .probe import CommProbe

LR_SCHEDULE = (1.0, 0.5, 0.25)   # per step, times the lr the optimizer was built with (the last one repeats)


def schedule_lr(optimizer: Any, kwargs: dict[str, Any], step: int) -> None:
    """Set param_groups' lr for `step`, as torch.optim.lr_scheduler does; step 0 keeps the lr the optimizer was
    built with (so that a constructor that drops its kwargs still shows), and kwargs without an lr are left alone."""
    if "lr" in kwargs and step > 0:
        for group in optimizer.param_groups:
            group["lr"] = kwargs["lr"] * LR_SCHEDULE[min(step, len(LR_SCHEDULE) - 1)]


def reference_optimizer_run(optimizer_cls: Any, kwargs: dict[str, Any], steps: int) -> dict[str, Any]:
    """One process, whole batch, optimizer_cls over all parameters, its lr scheduled (LR_SCHEDULE): parameters
    after each step, the same without the schedule ("unscheduled": what a step() deaf to param_groups follows),
    and the state bytes the unsharded optimizer holds at the end."""
    out: dict[str, Any] = {"init": snapshot(build_checknet(SEED))}
    for key, scheduled in (("unscheduled", False), ("params", True)):
        model = build_checknet(SEED)
        optimizer = optimizer_cls(model.parameters(), **kwargs)
        out[key] = []
        for step in range(steps):
            check_loss(model, *check_batch(step, 0, 1)).backward()
            if scheduled:
                schedule_lr(optimizer, kwargs, step)
            optimizer.step()
            for p in model.parameters():
                p.grad = None
            out[key].append(snapshot(model))
    held = state_holdings(optimizer, model.parameters())
    return {**out, "state_bytes": held.bytes, "owned": held.owned}


def drive_sharded(ctx: Any, sharded_cls: Any, optimizer_cls: Any, kwargs: dict[str, Any],
                  steps: int) -> dict[str, Any]:
    """Build sharded_cls(params, optimizer_cls, **kwargs) on this rank and take `steps` steps with averaged
    gradients, recording parameters, collectives and the optimizer state this rank holds."""
    model = build_checknet(SEED)
    out: dict[str, Any] = {"rank": ctx.rank, "reference": reference_optimizer_run(optimizer_cls, kwargs, steps),
                           "params": param_table(model, param_names(model)), "steps": []}
    with CommProbe() as probe:
        with learner_part(ctx, "constructor"), probe.phase("constructor"):
            optimizer = sharded_cls(model.parameters(), optimizer_cls, **kwargs)
        for step in range(steps):
            ctx.heartbeat(step)
            check_loss(model, *check_batch(step, ctx.rank, ctx.world_size)).backward()
            with probe.paused(), torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(ctx.world_size)
            schedule_lr(optimizer, kwargs, step)
            with learner_part(ctx, "step", step), probe.phase("step", step):
                optimizer.step()
            for p in model.parameters():
                p.grad = None
            out["steps"].append({"params": snapshot(model)})
        with probe.paused():
            dist.barrier()
    held = state_holdings(optimizer, model.parameters())
    out.update(state_bytes=held.bytes, owned=held.owned, owned_elements=held.owned_elements, events=probe.events)
    return out
