"""One rank's life, the same whoever started it (labkit's launcher, rank.py; or torchrun, torchrun.py):

    ctx = join(JoinSpec(rank=r, world_size=n, local_rank=r, ranks_here=n, backend="auto", run_dir=d,
                        config=cfg, timeout_s=120), store)    # backend and device chosen, group joined, recorder open
    try:
        fn(ctx)
    except BaseException as exc:
        write_rank_error(ctx.run_dir, ctx.rank, ctx.step, exc)   # rank<r>.error.json: Run.failure() reads it
        raise
    finally:
        leave(ctx)                                               # recorder closed, process group destroyed

A launched function takes one argument, the RankContext (labkit/context.py).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..context import Beats, RankContext
from ..records import FAILURE_MARKER, RankRecorder, rank_error
from ..rundir import RunDir

__all__ = ["JoinSpec", "RankContext", "join", "leave", "write_rank_error", "nccl_problem", "resolve_backend",
           "rank_device"]


@dataclass(frozen=True)
class JoinSpec:
    """Who a rank is and how it joins, as its launcher knows it."""

    rank: int
    world_size: int
    local_rank: int
    ranks_here: int
    """Ranks on this machine (each needs a GPU of its own under nccl)."""
    backend: str
    run_dir: Path
    config: RunConfig | None
    timeout_s: float
    """The process group's timeout."""


def join(spec: JoinSpec, store: Any, heartbeats: Beats | None = None) -> RankContext:
    """Pick the backend and device, join the process group on `store`, open the rank's records."""
    import torch.distributed as dist
    backend = resolve_backend(spec.backend, spec.ranks_here)
    device = rank_device(backend, spec.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.timeout_s))
    recorder = RankRecorder(spec.run_dir, spec.rank)
    return RankContext(rank=spec.rank, world_size=spec.world_size, local_rank=spec.local_rank, backend=backend,
                       device=device, run_dir=Path(spec.run_dir), config=spec.config, recorder=recorder,
                       heartbeats=heartbeats)


def leave(ctx: RankContext | None, *, destroy_group: bool = True) -> None:
    """Close the records and, with `destroy_group`, leave the process group (if this rank got that far).

    A rank of labkit's launcher that failed passes destroy_group=False: destroying a gloo group while a peer is
    still inside a collective can wait for that collective, and the launcher learns of the failure only when the
    process exits (it exits at once, and the launcher stops the others)."""
    import torch.distributed as dist
    if ctx is not None:
        ctx.recorder.close()
    if destroy_group and dist.is_initialized():
        dist.destroy_process_group()


def write_rank_error(run_dir: str | Path, rank: int, step: int, exc: BaseException, *, to_log: bool = True) -> None:
    """The one error record of a failed rank: rank<r>.error.json (Run.failure reads the earliest) and, with
    `to_log`, FAILURE_MARKER and the traceback on stderr, which is the rank's log under labkit's launcher (the live
    echo stops at the marker). Under torchrun the exception goes on up, and torchrun prints it itself."""
    error = rank_error(rank, step, exc)
    if to_log:
        sys.stderr.write(f"{FAILURE_MARKER} at step {step} ({type(exc).__name__}); the launcher reports the cause\n"
                         f"{error['traceback']}")
        sys.stderr.flush()
    RunDir(run_dir).error(rank).write_text(json.dumps(error, indent=2))


def nccl_problem(ranks_here: int) -> str | None:
    """Why `ranks_here` ranks on this machine cannot use NCCL (one CUDA device each), or None when they can.
    Asks the driver for the device count only: no CUDA context is created, so forking stays safe."""
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices >= ranks_here:
        return None
    return (f"backend='nccl' needs {ranks_here} CUDA GPUs here, one per rank on this machine; {devices} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Use backend='gloo' or "
            "'auto' (gloo runs on the CPU), or fewer ranks per machine.")


def resolve_backend(requested: str, world_size: int) -> str:
    """"auto" -> nccl when every rank can have its own CUDA device, else gloo; explicit names pass through, but
    nccl only when each of the `world_size` ranks on this machine has a CUDA device of its own (NCCL refuses two
    ranks on one GPU)."""
    import torch.distributed as dist
    problem = nccl_problem(world_size) if requested == "nccl" else None
    if problem:
        raise ValueError(problem)
    if requested != "auto":
        return requested
    cuda_ok = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    return "nccl" if cuda_ok and dist.is_nccl_available() else "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU (cuda:<local rank>) under nccl, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
