"""A rank that torchrun started (`torchrun ... -m labkit run config.json --run-dir DIR`): the same rank session as
a rank of labkit's launcher (session.py), on torchrun's rendezvous, writing the same run directory.

    torchrun --nproc-per-node 2 -m labkit run config.json --run-dir runs/job1
    under_torchrun()        # True in a process torchrun started (cli.py asks)

Restarts (torchrun --max-restarts): every attempt's records go to the same run directory, tagged with
TORCHELASTIC_RESTART_COUNT, and the loop resumes from the newest checkpoint there (RunConfig.checkpoint_every; the
same command run again later continues the job too). The process group is built on a store of this attempt's own
(elastic_store): restarted gloo groups built on the agent's shared store failed or hung here.
"""
from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..records import write_meta, write_outcome, write_tensorboard
from ..rundir import RunDir
from ..training.loop import train
from .session import JoinSpec, join, leave, write_rank_error


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun (or a launcher setting its variables) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_run_dir(config: RunConfig) -> Path:
    """Where a torchrun job writes when no --run-dir is given: the same path on every rank of the job."""
    from ..rundir import runs_root
    return runs_root() / f"{config.label}-{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}"


def run_under_torchrun(config: RunConfig, run_dir: Path | None, timeout: float) -> int:
    """This process is one rank that torchrun started: join its group, train, record, leave."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world != config.world_size:
        config = config.replace(world_size=world)  # torchrun decides the world; keep the records truthful
    run_dir = RunDir(run_dir or torchrun_run_dir(config))
    run_dir.path.mkdir(parents=True, exist_ok=True)  # every rank of every attempt writes here: never refused
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    spec = JoinSpec(rank=rank, world_size=world, local_rank=local_rank,
                    ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", world)), backend=config.backend,
                    run_dir=run_dir.path, config=config, timeout_s=timeout)
    ctx = join(spec, elastic_store(rank, world, timedelta(seconds=timeout)))
    try:
        placement = where_ranks_run(rank, local_rank, ctx.device)  # every rank joins: one all_gather_object
        if rank == 0 and not run_dir.meta.exists():  # a restart keeps the first attempt's
            config.save(run_dir.config)
            write_meta(run_dir, name=config.label, world_size=world, start_method="torchrun", **placement)
        train(ctx, config)
        end_together(rank, world, run_dir, ctx.device)
    except BaseException as exc:
        write_rank_error(run_dir, rank, ctx.step, exc, to_log=False)  # torchrun prints the traceback itself
        if isinstance(exc, Exception):
            record_for_torchrun(exc)
        raise
    finally:
        leave(ctx)
        if config.tensorboard:
            write_tensorboard(run_dir, ranks=[rank])  # each rank converts its own records, after training
    return 0


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_gone(exc: BaseException) -> bool:
    """Whether `exc` is a rank's collective failing because a peer's connection closed: the peer failed first."""
    return any(text in str(exc) for text in PEER_GONE)


def record_for_torchrun(exc: Exception) -> None:
    """Write the exception where torchrun's agent reads a rank's error (TORCHELASTIC_ERROR_FILE), as torchelastic's
    @record decorator does: the agent's summary then names the first failure with its traceback ("Root Cause")
    instead of "error_file: <N/A>". Nothing happens outside torchrun (no such variable).

    Written whole or not at all (a temporary file, then os.replace): once a rank has failed, the agent SIGTERMs the
    others and reads the error file of every rank that exited non-zero, this one too; a rank stopped half-way
    through torchelastic's own write (ErrorHandler.record_exception truncates the file, then writes) left it empty,
    and the agent itself died on it (JSONDecodeError in torch.distributed.run: seen once in
    test_three_restarts_in_a_row_under_torchrun_elastic). The content is what record_exception writes."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)),
                                      "timestamp": str(error_second(exc))}}}
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(data, f)
    os.replace(partial, path)


def error_second(exc: BaseException, now: float | None = None) -> int:
    """The whole second torchrun's agent is told a rank failed at: rounded down, or up for a failure that a peer's
    failure caused (peer_gone).

    The agent names as "Root Cause" the failed rank with the earliest timestamp, in whole seconds, ties going to the
    lowest rank. A rank that raises closes its sockets as it leaves, and its peers' collectives fail within the same
    second: the summary blamed rank 0, whose peer had raised (seen once in test_nodes under load). The consequence
    happened after the cause, so rounding its time up and the cause's down keeps that order in whole seconds."""
    now = time.time() if now is None else now
    return math.ceil(now) if peer_gone(exc) else math.floor(now)


def elastic_store(rank: int, world: int, timeout: timedelta) -> Any:
    """The rendezvous store of this attempt: torchrun's TCPStore (MASTER_ADDR:MASTER_PORT) under a prefix of its own.

    torchrun's agent keeps one store for the whole job and tells restarted ranks to reuse it; the process group's
    keys in it do not change between attempts, so a restarted gloo group could read the previous attempt's addresses
    (`connectFullMesh ... Connection refused`) or wait on keys already consumed (a hang): in one probe of 10
    restarts on a 2-core machine (torch 2.13, gloo, plain env:// init), 5 failed that way. Under a prefix per
    attempt (TORCHELASTIC_RESTART_COUNT) the same probe had none fail, and tests/test_resume.py restarts labkit's
    loop 10 times in a row. Without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), rank 0 hosts it."""
    import torch.distributed as dist
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    else:
        base = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"labkit/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)


def where_ranks_run(rank: int, local_rank: int, device: torch.device) -> dict[str, Any]:
    """Which node, host and device each rank of a torchrun job runs on, for meta.json (collective: every rank calls).

    torchrun numbers the nodes (GROUP_RANK) and the ranks on each node (LOCAL_RANK); global ranks are contiguous
    per node. Written once, by rank 0, so a run read back later says how the job was laid out."""
    import torch.distributed as dist
    mine = {"rank": rank, "local_rank": local_rank, "node": int(os.environ.get("GROUP_RANK", 0)),
            "host": socket.gethostname(), "device": str(device)}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"nodes": len({r["node"] for r in every}), "ranks": every}


def end_together(rank: int, world: int, run_dir: RunDir, device: torch.device) -> None:
    """Wait for every rank to finish training; then rank 0 records the outcome and checks that the run directory
    holds every rank's records (on many nodes it must be a filesystem they all mount)."""
    import torch.distributed as dist
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    if rank != 0:
        return
    write_outcome(run_dir, None)
    missing = run_dir.missing_records(world)
    if missing:
        print(f"labkit: {run_dir.path} holds no records of ranks {missing}: they wrote to their own node's disk. "
              "Give --run-dir a path on a filesystem every node mounts (NFS, Lustre, a ReadWriteMany volume).",
              file=sys.stderr)
