"""Inside each rank: drive a learner's DDP wrapper through a few training steps, watched, and keep what it did.

    outcome = drive_ddp(ctx, MyDDP, {"bucket_size_mb": 0.01}, steps=3)     # a dict the checker reads back

Each rank wraps a CheckNet initialised from its own seed (separate processes initialise separately: the wrapper's
broadcast must fix that), and trains it with SGD on its rows of each step's batch. Before each step the rank also
computes, from its current parameters, the single-process gradient of the whole batch and the gradient of its own
rows alone: what a correct wrapper must produce, and what an unsynchronised one leaves.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .checknet import build_checknet, check_batch, check_loss, grad_snapshot, param_names, snapshot
from .learner import learner_part
from .probe import CommProbe

SEED = 1234
LR = 0.1


def reference_run(steps: int) -> list[dict[str, torch.Tensor]]:
    """One process on the whole batch, from rank 0's start: the parameters after each SGD step."""
    model = build_checknet(SEED)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    params = []
    for step in range(steps):
        check_loss(model, *check_batch(step, 0, 1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        params.append(snapshot(model))
    return params


def expected_grads(model: torch.nn.Module, step: int, rank: int, world_size: int) -> tuple[dict, dict]:
    """At `model`'s current parameters: the single-process gradient of the whole batch, and the gradient of this
    rank's rows alone (what a rank holds if nothing is averaged)."""
    whole, mine = build_checknet(SEED), build_checknet(SEED)
    for copy, (inputs, targets) in ((whole, check_batch(step, 0, 1)), (mine, check_batch(step, rank, world_size))):
        copy.load_state_dict(model.state_dict())
        check_loss(copy, inputs, targets).backward()
    return grad_snapshot(whole), grad_snapshot(mine)


def drive_ddp(ctx: Any, wrapper_cls: Any, kwargs: dict[str, Any], steps: int) -> dict[str, Any]:
    """Wrap a CheckNet (initialised differently on each rank) in `wrapper_cls(model, **kwargs)` and train it for
    `steps` SGD steps on this rank's rows, recording parameters, gradients, collectives and times."""
    model = build_checknet(SEED + ctx.rank)  # separate processes initialise separately: the broadcast must fix it
    names = param_names(model)
    out: dict[str, Any] = {"rank": ctx.rank, "reference": reference_run(steps), "own_init": snapshot(model),
                           "steps": [], "params": param_table(model, names)}
    with CommProbe() as probe:
        with learner_part(ctx, "constructor"), probe.phase("constructor"):
            wrapped = wrapper_cls(model, **kwargs)
        out["after_init"] = snapshot(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        for step in range(steps):
            ctx.heartbeat(step)
            expected, local = expected_grads(model, step, ctx.rank, ctx.world_size)
            inputs, targets = check_batch(step, ctx.rank, ctx.world_size)
            with learner_part(ctx, "forward", step), probe.phase("forward", step):
                loss = check_loss(wrapped, inputs, targets)
            with learner_part(ctx, "backward (your gradient hooks run here)", step), probe.phase("backward", step):
                backward_start = time.perf_counter()
                loss.backward()
                backward_end = time.perf_counter()
            with learner_part(ctx, "finish_gradient_synchronization", step), probe.phase("finish", step):
                wrapped.finish_gradient_synchronization()
            finish_end = time.perf_counter()
            unfinished = probe.unfinished(step)
            out["steps"].append({"grads": grad_snapshot(model), "expected": expected, "local": local,
                                 "tensors": _tensor_names(model, names),
                                 "backward_start": backward_start, "backward_end": backward_end,
                                 "finish_end": finish_end, "unfinished": unfinished})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out["steps"][-1]["params"] = snapshot(model)
        with probe.paused():
            dist.barrier()  # no rank leaves while a peer's async work may still be in flight
    out["events"] = probe.events
    return out


def param_table(model: torch.nn.Module, names: dict[int, list[str]]) -> list[dict[str, Any]]:
    """One row per parameter tensor: its names, bytes, whether it is trained."""
    return [{"name": names[id(p)][0], "label": " = ".join(names[id(p)]), "tied": len(names[id(p)]) > 1,
             "numel": p.numel(), "bytes": p.numel() * p.element_size(),
             "requires_grad": p.requires_grad} for p in model.parameters()]


def _tensor_names(model: torch.nn.Module, names: dict[int, list[str]]) -> dict[int, str]:
    """data_ptr -> what lives there: a parameter's gradient or the parameter itself (to name all-reduced tensors)."""
    found: dict[int, str] = {}
    for param in model.parameters():
        label = " = ".join(names[id(param)])
        found[param.data_ptr()] = f"parameter {label}"
        if param.grad is not None:
            found[param.grad.data_ptr()] = f"gradient {label}"
    return found
