"""Context parallelism inside a transformers model: labkit's attention (context.py) registered with transformers'
AttentionInterface, so that GPT-2 runs unchanged on a share of the sequence.

    traffic = split_attention(model, group=cp_group, method="ring", split="zigzag")   # once, on every rank
    ids, labels, position_ids = sequence_share(inputs, targets, rank_in_group, degree, "zigzag")
    task, group = place_context(model, task, config, mesh)               # in a run: the group from the run's mesh
    logits = model(input_ids=ids, position_ids=position_ids).logits      # this rank's rows; K/V from the others
    traffic.bytes_sent, traffic.pairs                                    # what this rank's attention did so far

Each rank holds the positions `context.positions(seq_len, rank, degree, split)` of every sample of its batch. The
model must be given them as `position_ids`: GPT-2 adds a learned embedding per position, and without them every
rank embeds its share as if it began the sentence (the attention still masks by the true positions, which it knows
from the split; so the loss barely moves while the logits are wrong: lesson 23's trap).

The loss, and how the batches are shared: shared.py (SharedBatches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import context as cp

NAME = "labkit_context"   # the attention implementation's name in transformers' registry


@dataclass
class Plan:
    """How one model's attention is split: the group, method and split every rank of the group uses."""
    group: Any
    method: str
    split: str
    traffic: cp.Traffic


_PLANS: dict[int, Plan] = {}   # id(model.config) -> its plan: the attention function gets the module, not the model


def split_attention(model: nn.Module, *, group: Any = None, method: str = "ring", split: str = "contiguous",
                    traffic: cp.Traffic | None = None) -> cp.Traffic:
    """Make `model`'s self-attention context-parallel over `group` (None: the whole world), in place; returns the
    Traffic its forward passes add to.  split_attention(gpt2, method="ulysses")"""
    if method not in cp.METHODS:
        raise ValueError(f"method = {method!r}: must be one of {cp.METHODS}")
    if split not in cp.SPLITS:
        raise ValueError(f"split = {split!r}: must be one of {cp.SPLITS}")
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, _attention)
    plan = Plan(group, method, split, traffic or cp.Traffic())
    _PLANS[id(model.config)] = plan
    model.set_attn_implementation(NAME)
    return plan.traffic


def sequence_share(inputs: torch.Tensor, targets: torch.Tensor, rank: int, degree: int,
                   split: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's columns of a [batch, seq] batch, and their positions as position_ids ([batch, local]):
    sequence_share(ids, labels, 1, 2, "zigzag")."""
    pos = cp.positions(inputs.shape[1], rank, degree, split)
    return inputs[:, pos], targets[:, pos], pos.expand(inputs.shape[0], -1)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any):
    """transformers' attention signature: [b, h, s, d] in, ([b, s, h, d], no weights) out. The causal mask is
    placed by the split's positions (transformers' mask for the local share would be wrong across ranks)."""
    plan = _PLANS.get(id(module.config))
    if plan is None:
        raise RuntimeError(f"attention {NAME!r} on a model split_attention() was not called on")
    if dropout:
        raise ValueError("context-parallel attention has no attention dropout: build the model with attn_pdrop=0")
    if not getattr(module, "is_causal", True):
        raise ValueError("context-parallel attention is written for causal self-attention")
    scale = 1.0 / math.sqrt(query.shape[-1])
    if scaling is not None and not math.isclose(scaling, scale):
        query = query * (scaling / scale)   # context.block scales by 1/sqrt(head_dim)
    import torch.distributed as dist
    degree, me = dist.get_world_size(plan.group), dist.get_rank(plan.group)
    pos = cp.positions(query.shape[2] * degree, me, degree, plan.split)
    out = cp.attention(query, key, value, pos, method=plan.method, split=plan.split, group=plan.group,
                       stats=plan.traffic)
    return out.transpose(1, 2).contiguous(), None


def place_context(model: nn.Module, task: Any, config: Any, mesh: Any) -> tuple[Any, Any]:
    """Split `model`'s attention over this rank's context group (mesh.group("cp")) and share `task` (sliced over the
    data-parallel ranks) over the group's ranks; returns (task, group)."""
    from .shared import SharedBatches
    group = mesh.group("cp")
    traffic = split_attention(model, group=group, method=config.context_method, split=config.context_split)
    return SharedBatches(task, mesh.dims, mesh.rank, split=config.context_split, traffic=traffic), group
