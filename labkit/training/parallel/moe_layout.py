"""Placing tinymoe on the ranks: DDP for everything but the routed experts, which expert parallelism splits.

    wrapped, optimizer, more = place_experts(model, task, config, ctx, mesh, make_optimizer)   # strategies.distribute

Expert parallelism is carved out of data parallelism (as in DeepSeek-V3 and torchtitan), not a degree that
multiplies into the world size: with world_size W and expert_parallel P, every rank reads its own batch (W-way
data parallel), and the ranks form W / P expert-parallel groups of P neighbours, [0..P-1], [P..2P-1], ...; inside
one, rank r holds experts r*E/P .. (r+1)*E/P - 1 of every layer and trades tokens with the others
(parallel/experts.py). Each expert then has W / P copies, one per EP group, on ranks r, r+P, r+2P, ... (its
expert-data-parallel group).

Gradients: DDP all-reduces (averages over W) everything but the experts, which it is told to ignore: different
ranks hold different experts under the same names, and DDP would average them with each other. An expert's
gradient on its owner already sums what every rank of its EP group sent it (the all_to_all's backward brings it
back); summing over its W / P copies (one all-reduce over the expert-data-parallel group) and dividing by W gives
the gradient of the mean loss over all W ranks, what one process would compute on the whole batch. That happens
in an optimizer pre-step hook, so it runs once after all micro-batches; the bias update (training/routing.py)
runs in the next hook, after it. Gradient clipping would need a norm over ranks that hold different experts, so
config validation refuses it under expert parallelism; grad_norm records the norm of what this rank holds.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..commhooks import install_comm_hook
from .experts import ExpertBank, ExpertParallel, expert_parallel_modules
from ...config import RunConfig
from ...context import RankContext
from ...dims import ParallelDims


def expert_groups(world_size: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-data-parallel groups) of ranks, as ParallelDims carves them out of the data-parallel ranks:
    expert_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])."""
    dims = ParallelDims(dp=world_size, ep=ep)
    return dims.groups("ep"), dims.groups("edp")


def split_experts(model: nn.Module, mesh: Any) -> tuple[Any, Any]:
    """Replace every layer's fused experts by this rank's share (copies of its slices), in place; returns this
    rank's (EP group, expert-data-parallel group) from the run's mesh (mesh.py builds them, on every rank)."""
    ep_group, edp_group = mesh.expert_groups()
    split_experts_over(model, ep_group)
    return ep_group, edp_group


def split_experts_over(module: nn.Module, group: Any) -> None:
    """Replace the fused experts of every MoE layer inside `module` by this rank's share of them over `group`
    (rank i of the group owns experts i*E/n .. (i+1)*E/n - 1), in place. v3_layout.py passes a pipeline stage's
    data-parallel group."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    size, index = dist.get_world_size(group), dist.get_rank(group)
    for moe in [m for m in module.modules() if isinstance(m, DeepseekV3MoE)]:
        fused, share = moe.experts, fused_count(moe) // size
        first = index * share
        moe.experts = ExpertParallel(ExpertBank.from_fused(fused, range(first, first + share)), fused.num_experts,
                                     group=group)


def fused_count(moe: nn.Module) -> int:
    return moe.experts.num_experts


def place_experts(model: nn.Module, task: Any, config: RunConfig, ctx: RankContext, mesh: Any,
                  make_optimizer: Callable[[Any, Any], torch.optim.Optimizer]) -> tuple[Any, Any, Callable]:
    """DDP (and expert parallelism when config.expert_parallel > 1), the optimizer with its pre-step hooks, and a
    function giving the record fields to read after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ep, world = config.expert_parallel, ctx.world_size
    edp_group = None
    if ep > 1:
        _, edp_group = split_experts(model, mesh)
        DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names(model))
    wrapped = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                  bucket_cap_mb=config.bucket_cap_mb, broadcast_buffers=config.broadcast_buffers)
    install_comm_hook(wrapped, config.comm_hook, powersgd_rank=config.powersgd_rank)
    optimizer = make_optimizer(config, model.parameters())
    if ep > 1:
        params = [p for m in expert_parallel_modules(model) for p in m.parameters()]
        optimizer.register_step_pre_hook(lambda *_: sync_expert_grads(params, edp_group, world))
    task.routing.attach(optimizer)

    def more() -> dict[str, Any]:
        fields = task.routing.fields_after_step()
        stats = [m.take_stats() for m in expert_parallel_modules(model)]
        if stats:
            fields.update({f"ep_{key}": sum(s[key] for s in stats) for key in stats[0]})
        return fields
    return wrapped, optimizer, more


def expert_names(model: nn.Module) -> list[str]:
    """Names (in model's state_dict) of the parameters expert parallelism owns."""
    return [name for name, p in model.named_parameters() if ".experts.bank." in name]


@torch.no_grad()
def sync_expert_grads(params: list[nn.Parameter], group: Any, world_size: int) -> None:
    """Sum each expert's gradient over its copies (group), then divide by world_size: the mean over all ranks."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
        p.grad /= world_size
