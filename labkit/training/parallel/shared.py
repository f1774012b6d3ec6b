"""Ranks that read one batch together: tensor-parallel ranks (all of it) and context-parallel ranks (each a share of
every sample's positions). One wrapper for both, read from the run's ParallelDims.

    task = SharedBatches(make_task(config, dims.dp), dims, rank)                   # TP: rank reads its replica's rows
    task = SharedBatches(inner, dims, rank, split="zigzag", traffic=traffic)      # and CP: its positions of them
    inputs, targets = task.batch(step, micro, rank)
    loss, extras = task.loss(model, inputs, targets)    # CP: position_ids passed, the attention's traffic in extras

Under context parallelism each rank's loss is the mean cross-entropy over its tokens. The shares are equal, so the
mean over a context group is the mean over the whole sequence, and a data-parallel reduction over dp x cp averages
the gradients into one process's on the whole batch (attention's backward sends each rank the gradients its K and V
got from the others). The loss's extras then carry the step's attention traffic: cp_bytes (bytes this rank sent in
forward for attention), cp_pairs ((query, key) pairs the causal mask let it see), cp_scores (scores it computed,
masked ones included: its work), cp_blocks_skipped (blocks the causal mask hid whole).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...dims import ParallelDims
from ..taskbase import Task
from . import context as cp


class SharedBatches(Task):
    """`inner` (sliced over dims.dp data-parallel shares) as every rank of dims reads it (see the module
    docstring)."""

    def __init__(self, inner: Task, dims: ParallelDims, rank: int, *, split: str = "contiguous",
                 traffic: cp.Traffic | None = None):
        self.inner, self.dims, self.rank, self.split = inner, dims, rank, split
        self.traffic = traffic if traffic is not None else cp.Traffic()
        self.config, self.world_size, self.batch_size = inner.config, inner.world_size, inner.batch_size
        self.loss_floor, self.tokens_per_sample = inner.loss_floor, inner.tokens_per_sample
        self.at = dims.coords(rank)
        self._step: int | None = None
        self._start = cp.Traffic()

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = self.dims.coords(rank)
        inputs, targets = self.inner.batch(step, micro, at["dp"])
        if self.dims.cp == 1:
            return inputs, targets
        if step != self._step:   # the extras of a step sum its micro-batches
            self._step, self._start = step, cp.Traffic(**vars(self.traffic))
        pos = cp.positions(inputs.shape[1], at["cp"], self.dims.cp, self.split)
        return inputs[:, pos], targets[:, pos]

    def loss(self, model: Any, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if self.dims.cp == 1:
            return self.inner.loss(model, inputs, targets)
        pos = cp.positions(inputs.shape[1] * self.dims.cp, self.at["cp"], self.dims.cp, self.split)
        logits = model(input_ids=inputs, position_ids=pos.expand(inputs.shape[0], -1)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        now, start = self.traffic, self._start
        return loss, {"cp_bytes": now.bytes_sent - start.bytes_sent, "cp_pairs": now.pairs - start.pairs,
                      "cp_scores": now.scores - start.scores,
                      "cp_blocks_skipped": now.blocks_skipped - start.blocks_skipped}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {} if self.dims.cp > 1 else self.inner.evaluate(model)

    def model_fields(self, model: nn.Module) -> dict[str, int]:
        return self.inner.model_fields(model)

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()
