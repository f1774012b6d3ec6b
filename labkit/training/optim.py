"""The optimizer a RunConfig names, built the same way by the loop and by every parallel strategy:

    optimizer = make_optimizer(config, model.parameters())     # SGD (momentum), Adam or AdamW at config.lr

Its own module so that the loop (loop.py) and the strategies (parallel/strategies.py, which wrap it for ZeRO-1)
both import it, and neither has to hand it to the other.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..config import RunConfig

__all__ = ["make_optimizer"]


def make_optimizer(config: RunConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer named by config.optimizer, at config.lr (the LR schedule changes it every step)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
