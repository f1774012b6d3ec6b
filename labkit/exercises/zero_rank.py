"""Inside each rank: drive a learner's sharded optimizer through a few steps, watched, and keep what it did.

    outcome = drive_sharded(ctx, MyShardedOptimizer, torch.optim.AdamW, {"lr": 0.01}, steps=3)

Every rank builds the same CheckNet, computes the gradient of its rows, and the driver averages the gradients
itself (unwatched), so that only the optimizer is under test: ShardedOptimizer(model.parameters(), optimizer_cls,
**optimizer_kwargs).step() must then leave every rank with the parameters one process running optimizer_cls on
the whole batch has. The frozen parameter is passed in too (it has no gradient: no state, no update).
Before each step the driver sets the learning rate on the optimizer's param_groups as an LR scheduler would
(LR_SCHEDULE), so a step() that never passes param_groups' settings on to the optimizer that steps is caught.
The parameters come in param groups, as in most training scripts: the weights, the biases without weight decay (or,
if there is none, at half the lr), and the frozen layer, so that each group's settings must reach its parameters.

optimizer_cls reaches the learner's class as a subclass of it that notes which of the learner's functions built
it and added its param groups, and, each time it steps, any setting of its groups that differs from the setting
the learner's own param_groups hold for the same parameter.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .checknet import build_checknet, check_batch, check_loss, global_batch_for, param_names, snapshot
from .ddp_rank import SEED, learner_caller, learner_call, param_table
from .holdings import state_holdings
from .probe import CommProbe

LR_SCHEDULE = (1.0, 0.5, 0.25)   # per step, times the lr the optimizer was built with (the last one repeats)


def param_groups(model: torch.nn.Module, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """The param groups the checker passes, as a training script would: the trained weights with the optimizer's
    kwargs, the trained biases with weight_decay=0.0 (or at half the lr when there is no weight decay to turn
    off), and the frozen layer on its own."""
    biases = {"weight_decay": 0.0} if kwargs.get("weight_decay") else {"lr": kwargs["lr"] / 2} if "lr" in kwargs \
        else {}
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trained if p.dim() > 1]}, {"params": [p for p in trained if p.dim() <= 1], **biases},
            {"params": [p for p in model.parameters() if not p.requires_grad]}]


def schedule_lr(optimizer: Any, base_lrs: list[float], step: int) -> None:
    """Set each param_group's lr for `step` from its lr at construction (`base_lrs`), as torch.optim.lr_scheduler
    does; step 0 keeps the lr the optimizer was built with (so that a constructor that drops its kwargs still
    shows)."""
    if step > 0:
        for group, base in zip(optimizer.param_groups, base_lrs):
            if base is not None:
                group["lr"] = base * LR_SCHEDULE[min(step, len(LR_SCHEDULE) - 1)]


def watched_optimizer(optimizer_cls: Any, notes: dict[str, Any]) -> Any:
    """optimizer_cls, noting who builds it and adds its groups, and settings that differ from the learner's own
    param_groups when it steps (see the module docstring)."""

    class Watched(optimizer_cls):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            notes["built_by"].append(learner_caller())
            super().__init__(*args, **kwargs)

        def add_param_group(self, param_group: dict[str, Any]) -> None:
            notes["grouped_by"].append(learner_caller())
            super().add_param_group(param_group)

        def step(self, *args: Any, **kwargs: Any) -> Any:
            outer = notes.get("outer")
            theirs = {id(p): g for g in getattr(outer, "param_groups", []) for p in g["params"]}
            for group in self.param_groups:
                for param in group["params"]:
                    mine = theirs.get(id(param))
                    for key in sorted(set(group) & set(mine or {}) - {"params"}):
                        if mine is not None and not _same(group[key], mine[key]):
                            notes["mismatches"].append({"step": notes["step"], "index": notes["index"].get(id(param)),
                                                        "key": key, "inner": group[key], "outer": mine[key]})
            return super().step(*args, **kwargs)

    Watched.__name__, Watched.__qualname__ = optimizer_cls.__name__, optimizer_cls.__qualname__
    Watched.__module__ = optimizer_cls.__module__
    return Watched


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):   # tensors with several elements: not compared
        return True


def reference_optimizer_run(optimizer_cls: Any, kwargs: dict[str, Any], steps: int,
                            global_batch: int) -> dict[str, Any]:
    """One process, whole batch, optimizer_cls over all parameters, its lr scheduled (LR_SCHEDULE): parameters
    after each step, the same without the schedule ("unscheduled": what a step() deaf to param_groups follows),
    and the state bytes the unsharded optimizer holds at the end."""
    out: dict[str, Any] = {"init": snapshot(build_checknet(SEED))}
    for key, scheduled in (("unscheduled", False), ("params", True)):
        model = build_checknet(SEED)
        optimizer = optimizer_cls(param_groups(model, kwargs), **kwargs)
        base_lrs = [g.get("lr") for g in optimizer.param_groups]
        out[key] = []
        for step in range(steps):
            check_loss(model, *check_batch(step, 0, 1, global_batch)).backward()
            if scheduled:
                schedule_lr(optimizer, base_lrs, step)
            optimizer.step()
            for p in model.parameters():
                p.grad = None
            out[key].append(snapshot(model))
    held = state_holdings(optimizer, model.parameters())
    return {**out, "state_bytes": held.bytes, "owned": held.owned}


def drive_sharded(ctx: Any, sharded_cls: Any, optimizer_cls: Any, kwargs: dict[str, Any],
                  steps: int) -> dict[str, Any]:
    """Build sharded_cls(param_groups, optimizer_cls, **kwargs) on this rank and take `steps` steps with averaged
    gradients, recording parameters, collectives, the optimizer state this rank holds and what its inner
    optimizer was given."""
    model = build_checknet(SEED)
    batch = global_batch_for(ctx.world_size)
    cls = getattr(sharded_cls, "__qualname__", getattr(sharded_cls, "__name__", "optimizer"))
    notes: dict[str, Any] = {"built_by": [], "grouped_by": [], "mismatches": [], "step": -1,
                             "index": {id(p): i for i, p in enumerate(model.parameters())}}
    out: dict[str, Any] = {"rank": ctx.rank, "class": cls,
                           "reference": reference_optimizer_run(optimizer_cls, kwargs, steps, batch),
                           "params": param_table(model, param_names(model)), "steps": [],
                           "ptrs": {p.data_ptr(): i for i, p in enumerate(model.parameters())}}
    with CommProbe() as probe:
        with learner_call(ctx, f"{cls}.__init__"), probe.phase("constructor"):
            optimizer = sharded_cls(param_groups(model, kwargs), watched_optimizer(optimizer_cls, notes), **kwargs)
        notes["outer"] = optimizer
        if not isinstance(getattr(optimizer, "param_groups", None), list):   # Optimizer.__init__ never ran
            with probe.paused():
                dist.barrier()
            return {**out, "unbuilt": True}
        base_lrs = [g.get("lr") for g in optimizer.param_groups]
        for step in range(steps):
            ctx.heartbeat(step)
            notes["step"] = step
            check_loss(model, *check_batch(step, ctx.rank, ctx.world_size, batch)).backward()
            with probe.paused(), torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(ctx.world_size)
            schedule_lr(optimizer, base_lrs, step)
            with learner_call(ctx, f"{cls}.step", step), probe.phase("step", step):
                optimizer.step()
            for p in model.parameters():
                p.grad = None
            out["steps"].append({"params": snapshot(model)})
        with probe.paused():
            dist.barrier()
    held = state_holdings(optimizer, model.parameters())
    out.update(state_bytes=held.bytes, owned=held.owned, owned_elements=held.owned_elements, events=probe.events,
               built_by=[c for c in notes["built_by"] + notes["grouped_by"] if c],
               mismatches=[{k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                            for k, v in m.items()} for m in notes["mismatches"][:20]])
    return out
