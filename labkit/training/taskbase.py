"""What every task provides: a model, this rank's slice of a deterministic global batch, and a loss.

    class MyTask(Task):                     # tasks.py and moe_task.py hold the built-in ones
        def build_model(self): ...
        def batch(self, step, micro, rank): ...     # rows self.rows(micro, rank) of step's global batch
        def loss(self, model, inputs, targets): ... # (loss, extras recorded with the step)
"""
from __future__ import annotations

import torch
from torch import nn
from ..config import RunConfig


class Task:
    """Shared slicing of the global batch; subclasses provide the data, the model and the loss."""

    loss_floor: float | None = None
    tokens_per_sample: int = 0

    def __init__(self, config: RunConfig, world_size: int | None = None):
        self.config = config
        self.world_size = world_size or config.world_size
        self.batch_size = config.global_batch // (self.world_size * config.grad_accum)

    def rows(self, micro: int, rank: int) -> slice:
        start = (micro * self.world_size + rank) * self.batch_size
        return slice(start, start + self.batch_size)

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}
