"""Run optimizers on real ranks to measure what ZeRO-1 is about: state bytes per rank, and the training curve.

    rows = measure_state({"AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          "yours": lambda ps: ShardedOptimizer(ps, torch.optim.AdamW, lr=1e-3)},
                         world_sizes=(1, 2, 4))          # a DataFrame: optimizer, world_size, rank, state_bytes, ...
    run = train_run(lambda ps: ShardedOptimizer(ps, torch.optim.AdamW, lr=3e-3), name="yours", steps=20)
    labkit.compare([run, ...])                           # loss curves side by side

Both train labkit's tinylm GPT-2 (the same seed and batches everywhere); gradients are averaged by torch's DDP, so
that the optimizer is the only thing that differs between runs. A factory takes the parameters and returns the
optimizer; lambdas defined in a notebook cell work (ranks are forked).
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn

from ..measure import usable_cores
from ..records import Run
from ..run import launch
from ..training.tasks import make_task
from .holdings import state_holdings
from .speeds import tinylm_config

Factory = Callable[[Any], torch.optim.Optimizer]


def measure_state(factories: dict[str, Factory], *, world_sizes: tuple[int, ...] = (1, 2, 4),
                  model_size: str = "small", runs_root: Any = None, timeout: float = 120.0) -> pd.DataFrame:
    """Optimizer state bytes each rank holds after one step, for every factory at every world size."""
    rows = []
    cores = usable_cores()
    for world_size in world_sizes:
        worker = functools.partial(_state_rank, factories=factories, config=tinylm_config(world_size, model_size))
        run = launch(worker, world_size=world_size, timeout=timeout, echo=False, progress=False,
                     name=f"zero-state-w{world_size}", runs_root=runs_root)
        for rank in range(world_size):
            rows += [{**row, "world_size": world_size, "rank": rank, "oversubscribed": world_size > cores}
                     for row in run.result(rank)]
    return pd.DataFrame(rows)


def _state_rank(ctx: Any, factories: dict[str, Factory], config: Any) -> list[dict[str, Any]]:
    task = make_task(config, ctx.world_size)
    rows = []
    for label, factory in factories.items():
        torch.manual_seed(config.seed)
        model = task.build_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = factory(model.parameters())
        loss, _ = task.loss(ddp, *task.batch(0, 0, ctx.rank))
        loss.backward()
        optimizer.step()  # optimizers create their state on the first step
        optimizer.zero_grad(set_to_none=True)
        held = state_holdings(optimizer, model.parameters())
        rows.append({"optimizer": label, "state_bytes": held.bytes, "owned_elements": held.owned_elements,
                     "params": sum(p.numel() for p in model.parameters())})
    return rows


def train_run(factory: Factory, *, name: str, steps: int = 20, world_size: int = 2, model_size: str = "small",
              global_batch: int = 16, runs_root: Any = None, timeout: float = 120.0) -> Run:
    """Train tinylm with DDP and the optimizer `factory` makes; records loss, lr, samples and t_step per step."""
    worker = functools.partial(_train_rank, factory=factory, steps=steps,
                               config=tinylm_config(world_size, model_size, global_batch))
    return launch(worker, world_size=world_size, timeout=timeout, echo=False, progress=False, name=name,
                  runs_root=runs_root)


def _train_rank(ctx: Any, factory: Factory, steps: int, config: Any) -> None:
    task = make_task(config, ctx.world_size)
    torch.manual_seed(config.seed)
    model = task.build_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = factory(model.parameters())
    for step in range(steps):
        started = time.perf_counter()
        loss, _ = task.loss(ddp, *task.batch(step, 0, ctx.rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ctx.record(step, loss=loss.item(), samples=task.batch_size, tokens=task.batch_size * config.seq_len,
                   lr=optimizer.param_groups[0]["lr"], t_step=time.perf_counter() - started)
