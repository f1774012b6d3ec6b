"""The unused-expert traps, run for real: an expert that gets no tokens on one rank, under DDP and under FSDP2.

    run = launch(functools.partial(idle_expert, wrap="ddp"), config=RunConfig(task="tinymoe"), timeout=10)
    idle_expert(ctx, wrap="ddp")             # DDP over one parameter set per expert: raises at step 1
    idle_expert(ctx, wrap="ddp_unused")      # find_unused_parameters=True: runs, and searches the graph every step
    idle_expert(ctx, wrap="fsdp")            # FSDP2, each expert sharded on its own: both ranks hang at step 0
    idle_expert(ctx, wrap="ddp", every_expert=True)    # every expert runs, on no rows if it got none: no trap
    idle_expert(ctx, wrap="fsdp", fused=True)          # transformers' own fused experts: no trap either
    two_fixes(ctx, steps=30)                 # find_unused_parameters vs every expert, step by step, on each rank

The model is tinymoe's DeepSeek-V3 with transformers' fused experts swapped for one parameter set per expert
(parallel/experts.py, one process's share: all of them, no all_to_all). On rank `idle_rank` expert `idle` gets no
tokens: its routing bias is pushed far down there (and DDP told not to broadcast buffers, so it stays), as on a
rank whose batch holds nothing that expert is chosen for. Options are keyword arguments: launch
functools.partial(idle_expert, wrap="fsdp").

Why each fails: DDP's reducer expects a gradient for every parameter it holds; when one never arrives on a rank
it cannot finish the all-reduce of that bucket, and at the next step's forward it raises "Expected to have finished
reduction in the prior iteration" (with the parameter indices that got no gradient). FSDP2 all-gathers a module's
parameters just before it runs, and reduce-scatters its gradients after: on the idle rank the expert never runs,
so the ranks issue different sequences of collectives, and each waits in one the other never joins. With `fused`,
transformers' DeepseekV3Experts stays: all experts in two 3-D parameters, used whenever any expert runs (FSDP2 then
shards the fused module as one unit), so the idle expert is a zero slice of a gradient that exists.

`two_fixes` trains two copies of the model side by side in one launch, alternating which goes first: one under
DDP(find_unused_parameters=True) with the idle expert skipped, one under plain DDP with every expert run, and
records each one's forward and step seconds: the search for unused parameters happens at the end of DDP's
forward (a walk of the autograd graph from the outputs), plus an all-reduce of the used-parameter map in backward.
"""
from __future__ import annotations

import time
from typing import Any

import torch

WRAPS = ("ddp", "ddp_unused", "fsdp")
WRAP_MODULES = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.device_mesh",
                "transformers.models.deepseek_v3.modeling_deepseek_v3")
"""What the traps import (DDP imports torch._dynamo, about 1.5 s; transformers' DeepSeek-V3 about 2 s, measured in a
fresh process): warm_imports() before a timed launch, so the time is the hang's and not the imports'."""


def warm_imports() -> None:
    """Import WRAP_MODULES here, once, so that ranks forked from this process start with them:  warm_imports()."""
    import importlib
    for name in WRAP_MODULES:
        importlib.import_module(name)


def per_expert_model(config: Any) -> tuple[Any, Any]:
    """(task, model): tinymoe with one parameter set per expert in every layer, all experts local."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from ..moe_task import TinyMoE
    from .experts import ExpertBank, ExpertParallel
    task = TinyMoE(config)
    model = task.build_model()
    for moe in [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]:
        moe.experts = ExpertParallel(ExpertBank.from_fused(moe.experts), moe.experts.num_experts)
    return task, model


def idle_expert(ctx: Any, *, wrap: str = "ddp", every_expert: bool = False, fused: bool = False, idle: int = 0,
                idle_rank: int = 1, steps: int = 3) -> dict[str, Any]:
    """Train `steps` steps with expert `idle` idle on rank `idle_rank`; returns what the rank saw (see above)."""
    if wrap not in WRAPS:
        raise ValueError(f"wrap = {wrap!r}: pick one of {', '.join(WRAPS)}")
    task, model = _idle_model(ctx, every_expert, fused, idle, idle_rank)
    wrapped = _wrap(model, wrap, ctx, fused)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.config.lr)
    times = []
    for step in range(steps):
        ctx.heartbeat(step)
        started = time.perf_counter()
        loss, extras = task.loss(wrapped, *task.batch(step, 0, ctx.rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        ctx.record(step, loss=loss.item(), t_step=times[-1], expert_load=extras["expert_load"])
    return {"idle_tokens": [row[idle] for row in extras["expert_load"]], "t_steps": times}


def two_fixes(ctx: Any, *, steps: int = 30, idle: int = 0, idle_rank: int = 1) -> dict[str, Any]:
    """Both fixes of the DDP trap in one launch, step by step (see the module docstring); records per step
    t_fwd_unused, t_step_unused (find_unused_parameters, idle expert skipped), t_fwd_every, t_step_every (every
    expert run); returns each one's idle-expert tokens per layer on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    models = {}
    for name, every, unused in (("unused", False, True), ("every", True, False)):
        task, model = _idle_model(ctx, every, False, idle, idle_rank)
        models[name] = (task, DDP(model, broadcast_buffers=False, find_unused_parameters=unused),
                        torch.optim.AdamW(model.parameters(), lr=ctx.config.lr))
    idle_tokens = {}
    for step in range(steps):
        ctx.heartbeat(step)
        fields = {}
        for name in (list(models) if step % 2 == 0 else list(models)[::-1]):  # same order on every rank
            task, wrapped, optimizer = models[name]
            started = time.perf_counter()
            loss, extras = task.loss(wrapped, *task.batch(step, 0, ctx.rank))
            forward = time.perf_counter()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            fields.update({f"t_fwd_{name}": forward - started, f"t_step_{name}": time.perf_counter() - started})
            idle_tokens[name] = [row[idle] for row in extras["expert_load"]]
        ctx.record(step, **fields)
    return {"idle_tokens": idle_tokens}


def _idle_model(ctx: Any, every_expert: bool, fused: bool, idle: int, idle_rank: int) -> tuple[Any, Any]:
    from ..moe_task import TinyMoE
    from ..seeding import seed_everything
    from .experts import expert_parallel_modules
    seed_everything(ctx.config.seed)
    if fused:
        task = TinyMoE(ctx.config)
        model = task.build_model()
    else:
        task, model = per_expert_model(ctx.config)
    for module in expert_parallel_modules(model):
        module.every_expert = every_expert
    if ctx.rank == idle_rank:
        for router in task.routing.routers:
            router.e_score_correction_bias[idle] = -1e4  # never chosen here
    return task, model


def _wrap(model: Any, wrap: str, ctx: Any, fused: bool) -> Any:
    if wrap in ("ddp", "ddp_unused"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, broadcast_buffers=False, find_unused_parameters=wrap == "ddp_unused")
    from torch.distributed.fsdp import fully_shard
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    from .fullshard import quiet_warnings
    from .experts import Expert
    from .mesh import world_mesh
    quiet_warnings()
    mesh = world_mesh(ctx.device)
    unit = DeepseekV3Experts if fused else Expert
    for experts in [m for m in model.modules() if isinstance(m, unit)]:
        fully_shard(experts, mesh=mesh)  # per expert: one all-gather per expert, when it runs; fused: per layer
    fully_shard(model, mesh=mesh)
    return model
