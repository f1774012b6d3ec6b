"""The global gradient norm (and clipping to it) when gradients are sharded: FSDP shards, tensor-parallel slices.

    norm = clip_or_measure(model.parameters(), clip_norm=1.0)   # or clip_norm=None: measure only

With plain tensors this is exactly torch's clip_grad_norm_ / get_total_norm. With DTensors torch's versions
need every gradient on one device mesh; tensor parallelism leaves embeddings and LayerNorms as plain replicated
tensors beside DTensor slices, and FSDP over a 2-D mesh puts them on different meshes, so torch refuses
("got mixed torch.Tensor and DTensor"). The sum of squares is then added up by hand: each rank sums the squares
of what it holds, each piece weighted by 1 / (how many ranks hold that same piece), and one all-reduce over all
ranks adds the sums. A replicated tensor (held by all W ranks) counts 1/W on each, a piece sharded over every
rank counts once.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def clip_or_measure(params: Iterable[torch.Tensor], clip_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the gradients of `params`, before clipping them to `clip_norm` (None: no clipping)."""
    params = [p for p in params if p.grad is not None]
    norm = total_norm([p.grad for p in params])
    if clip_norm is not None:
        clip_with_norm(params, clip_norm, norm)
    return norm


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of `grads`: torch's get_total_norm for plain tensors, else summed over the shards."""
    if not any(_is_dtensor(g) for g in grads):
        return torch.nn.utils.get_total_norm(grads)
    return sharded_norm(grads)


def clip_with_norm(params: list[torch.Tensor], clip_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of `params` down so that their global norm `norm` becomes at most `clip_norm`."""
    grads = [p.grad for p in params]
    if not any(_is_dtensor(g) for g in grads):
        torch.nn.utils.clip_grads_with_norm_(params, clip_norm, norm)
        return
    coef = clip_norm / (float(norm) + 1e-6)  # torch's rule: scale down only, never up
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)


def sharded_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all ranks of gradients that may be DTensors on any mesh, or plain replicated tensors."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        piece = grad.to_local() if _is_dtensor(grad) else grad
        total += piece.detach().double().pow(2).sum() * (_distinct_pieces(grad) / world)
    if world > 1:
        dist.all_reduce(total)
    return total.sqrt().float()


def _distinct_pieces(grad: torch.Tensor) -> int:
    """Into how many different pieces `grad` is cut over the world (1 for a replicated tensor)."""
    if not _is_dtensor(grad):
        return 1
    mesh, pieces = grad.device_mesh, 1
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient is still a pending sum ({grad.placements}): reduce it before its norm")
        if not placement.is_replicate():  # Shard, and FSDP's _StridedShard on a tensor-parallel slice
            pieces *= mesh.size(dim)
    return pieces


def _is_dtensor(tensor: object) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)
