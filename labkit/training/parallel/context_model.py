"""Context parallelism inside a transformers model: labkit's attention (context.py) registered with transformers'
AttentionInterface, so that GPT-2 runs unchanged on a share of the sequence.

    traffic = split_attention(model, group=cp_group, method="ring", split="zigzag")   # once, on every rank
    ids, labels, position_ids = sequence_share(inputs, targets, rank_in_group, degree, "zigzag")
    logits = model(input_ids=ids, position_ids=position_ids).logits      # this rank's rows; K/V from the others
    traffic.bytes_sent, traffic.pairs                                    # what this rank's attention did so far

Each rank holds the positions `context.positions(seq_len, rank, degree, split)` of every sample of its batch. The
model must be given them as `position_ids`: GPT-2 adds a learned embedding per position, and without them every
rank embeds its share as if it began the sentence (the attention still masks by the true positions, which it knows
from the split; so the loss barely moves while the logits are wrong: lesson 23's trap).

The loss: each rank's mean cross-entropy over its tokens. Equal shares, so the mean over the group's ranks is the
mean over the whole sequence, and DDP over all ranks (data x context) averages the gradients into exactly one
process's on the whole batch: attention's backward sends each rank the gradients its K and V got from the others.
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


def context_groups(world_size: int, degree: int) -> list[list[int]]:
    """The ranks that split one batch's sequences: neighbours.  context_groups(4, 2) == [[0, 1], [2, 3]]"""
    return [list(range(g * degree, (g + 1) * degree)) for g in range(world_size // degree)]


class ContextShare:
    """A task whose batches are sliced over the data-parallel ranks (rank // degree) and, inside one context group,
    along the sequence: each rank gets its positions of every sample, and the loss passes them as position_ids.
    Its loss's extras carry the step's attention traffic: cp_bytes (bytes this rank sent in forward for
    attention), cp_pairs ((query, key) pairs the causal mask let it see), cp_scores (scores it computed, masked ones
    included: its work), cp_blocks_skipped (blocks the causal mask hid whole)."""

    def __init__(self, inner: Any, degree: int, split: str, traffic: cp.Traffic, rank: int):
        self.inner, self.degree, self.split, self.traffic, self.rank = inner, degree, split, traffic, rank
        self.config, self.world_size, self.batch_size = inner.config, inner.world_size, inner.batch_size
        self.loss_floor, self.tokens_per_sample = inner.loss_floor, inner.tokens_per_sample   # samples are credited 1/degree each
        self._step: int | None = None
        self._start = cp.Traffic()

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step != self._step:   # the extras of a step sum its micro-batches
            self._step, self._start = step, cp.Traffic(**vars(self.traffic))
        inputs, targets = self.inner.batch(step, micro, rank // self.degree)
        ids, labels, _ = sequence_share(inputs, targets, rank % self.degree, self.degree, self.split)
        return ids, labels

    def loss(self, model: Any, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        pos = cp.positions(inputs.shape[1] * self.degree, self.rank % self.degree, self.degree, self.split)
        logits = model(input_ids=inputs, position_ids=pos.expand(inputs.shape[0], -1)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        now, start = self.traffic, self._start
        return loss, {"cp_bytes": now.bytes_sent - start.bytes_sent, "cp_pairs": now.pairs - start.pairs,
                      "cp_scores": now.scores - start.scores,
                      "cp_blocks_skipped": now.blocks_skipped - start.blocks_skipped}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()


def place_context(model: nn.Module, task: Any, config: Any, rank: int) -> tuple[ContextShare, Any]:
    """Split `model`'s attention over this rank's context group and slice `task` for it; returns (task, group).
    Every rank must call it (it creates every group's process group, in the same order)."""
    import torch.distributed as dist
    degree = config.context_parallel
    made = [dist.new_group(ranks) for ranks in context_groups(config.world_size, degree)]
    group = made[rank // degree]
    traffic = split_attention(model, group=group, method=config.context_method, split=config.context_split)
    return ContextShare(task, degree, config.context_split, traffic, rank), group
