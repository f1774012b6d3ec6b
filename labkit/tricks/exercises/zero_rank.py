"""Inside each rank: drive a learner's sharded optimizer through a few steps, watched, and keep what it did.

    outcome = drive_sharded(ctx, MyShardedOptimizer, torch.optim.AdamW, {"lr": 0.01}, steps=3)

Every rank builds the same CheckNet, computes the gradient of its rows, and the driver averages the gradients
itself (unwatched), so that only the optimizer is under test: ShardedOptimizer(model.parameters(), optimizer_cls,
**optimizer_kwargs).step() must then leave every rank with the parameters one process running optimizer_cls on
the whole batch has. The frozen parameter is passed in too (it has no gradient: no state, no update).
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


def reference_optimizer_run(optimizer_cls: Any, kwargs: dict[str, Any], steps: int) -> dict[str, Any]:
    """One process, whole batch, optimizer_cls over all parameters: parameters after each step, and the state
    bytes that unsharded optimizer holds at the end."""
    model = build_checknet(SEED)
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    params = []
    for step in range(steps):
        check_loss(model, *check_batch(step, 0, 1)).backward()
        optimizer.step()
        for p in model.parameters():
            p.grad = None
        params.append(snapshot(model))
    held = state_holdings(optimizer, model.parameters())
    return {"params": params, "state_bytes": held.bytes, "owned": held.owned, "init": snapshot(build_checknet(SEED))}


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
