"""One tiny DDP job, started by four launchers (bench/first_launch.py): the work is the same, only the start differs.

Each rank joins a gloo group, wraps a small MLP in DistributedDataParallel (whose first construction imports
torch._dynamo in a process that has not), takes one optimizer step, and rank 0 writes the wall time at which that
step ended to $FIRST_STEP_OUT. Importable by spawned children (bench/ is on their sys.path), so nothing here may
be defined in a notebook cell.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def first_step(rank: int) -> None:
    """Build the DDP model and take one step; rank 0 notes when it ended."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model(torch.randn(16, 32)).pow(2).mean().backward()
    optimizer.step()
    if rank == 0:
        Path(os.environ["FIRST_STEP_OUT"]).write_text(repr(time.time()))


def labkit_rank(ctx: Any) -> None:
    """labkit.launch(labkit_rank, world_size=2): the group exists already; the step is recorded as usual."""
    first_step(ctx.rank)
    ctx.record(0)


def plain_rank(rank: int, world: int, port: int) -> None:
    """A rank started by multiprocessing (fork) or torch.multiprocessing.spawn: its own group over tcp://."""
    torch.set_num_threads(1)  # as labkit's ranks: one core each (and no fork-after-threads hang)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    first_step(rank)
    dist.destroy_process_group()


def accelerate_rank() -> None:
    """A rank started by accelerate's notebook_launcher, which sets RANK, WORLD_SIZE, MASTER_ADDR/PORT."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    first_step(int(os.environ["RANK"]))
    dist.destroy_process_group()


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the launchers that need one are told it; labkit's ranks pick their own)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
