"""The pipeline's traps, run on real ranks and named by stage and action: a rank cut into other microbatches (a
hang the watchdog bounds), a rank expecting other shapes (gloo's abort), a rank without numpy (shape inference
fails there).

    from labkit.tricks import pipeline_traps as traps
    failure, where = traps.mismatched_microbatches()   # the hang, bounded and named by stage and action
    print(traps.failure_line(failure, where))
    failure, saw = traps.without_numpy()               # shape inference on a rank without numpy: what each said
    traps.ranks_left(failure.run_dir)                  # [] once the launcher has reaped every rank
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import psutil
import torch

from ..config import RunConfig
from ..rundir import RunDir
from ..run import RankFailure
from ..run.launch import launch
from ..training.loop import train
from ..training.parallel.pipestep import now_path, read_now
from .pipeline import lesson_config

__all__ = ["mismatched_microbatches", "mismatched_sizes", "where_stages_were", "failure_line", "without_numpy",
           "ranks_left"]


def where_stages_were(run_dir: Any, world_size: int) -> dict[int, str]:
    """{rank: the action its stages were in or had just finished}, as each rank last wrote it."""
    return {rank: read_now(now_path(run_dir, rank)) for rank in range(world_size)}


@dataclasses.dataclass(frozen=True)
class _Disagreeing:
    """One rank builds its pipeline with other settings than its peers (a config that differs between ranks)."""
    rank: int
    changes: dict

    def __call__(self, ctx: Any) -> None:
        config = ctx.config.replace(**self.changes) if ctx.rank == self.rank else ctx.config
        train(ctx, config)


def mismatched_microbatches(config: RunConfig | None = None, *, rank: int = 0, microbatches: int = 2,
                            timeout: float = 8.0, runs_root: Any = None) -> tuple[RankFailure, dict[int, str]]:
    """Run a pipeline whose rank `rank` runs `microbatches` microbatches of the same size where the others run
    config.microbatches (its batch is smaller by as much): under GPipe the last stage waits for a forward that
    never comes while the first waits for a gradient. Returns the watchdog's RankFailure and, per rank, the stage
    and action it was in. (With the same batch cut into fewer, larger microbatches, the shapes disagree instead
    and the last stage raises on the first step.)"""
    config = config or lesson_config("GPipe", microbatches=4)
    rows = config.global_batch // config.microbatches
    return _expect_failure(config, {"microbatches": microbatches, "global_batch": rows * microbatches}, rank,
                           timeout, runs_root)


def mismatched_sizes(config: RunConfig | None = None, *, rank: int = 1, timeout: float = 8.0,
                     runs_root: Any = None) -> tuple[RankFailure, dict[int, str]]:
    """Run a pipeline with fixed shapes whose rank `rank` expects activations of another size (a longer
    sequence) than the stage before it sends: gloo aborts the receiving process (SIGABRT), as with collectives
    of mismatched sizes. Returns the RankFailure and where each rank's stages were."""
    config = config or lesson_config("GPipe", microbatches=4, pipeline_shapes="fixed")
    return _expect_failure(config.replace(pipeline_shapes="fixed"), {"seq_len": config.seq_len + 8,
                                                                    "pipeline_check": False}, rank, timeout,
                           runs_root)


def failure_line(failure: RankFailure, where: dict[int, str]) -> str:
    """The watchdog's verdict with the stage and action of every rank:  print(failure_line(*mismatched_sizes()))."""
    ranks = "; ".join(f"rank {r}: {text}" for r, text in sorted(where.items()))
    return f"rank {failure.rank} {failure.reason} at step {failure.step}: {failure.detail} [stages: {ranks}]"


def _expect_failure(config: RunConfig, changes: dict, rank: int, timeout: float,
                    runs_root: Any) -> tuple[RankFailure, dict[int, str]]:
    try:
        launch(_Disagreeing(rank, changes), config=config, timeout=timeout, echo=False, progress=False,
               runs_root=runs_root, name=f"{config.name} rank {rank} {changes}")
    except RankFailure as failure:
        return failure, where_stages_were(failure.run_dir, config.world_size)
    raise AssertionError(f"the pipeline with rank {rank} changed by {changes} finished: expected a failure")


@dataclasses.dataclass(frozen=True)
class _WithoutNumpy:
    """labkit's loop, with torch.Tensor.numpy raising on one rank what torch raises when numpy is not installed."""
    rank: int

    def __call__(self, ctx: Any) -> None:
        if ctx.rank == self.rank:
            torch.Tensor.numpy = _no_numpy  # this forked rank's torch only
        train(ctx, ctx.config)


def _no_numpy(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Numpy is not available")  # torch's own words when it was built or run without numpy


def without_numpy(config: RunConfig | None = None, *, rank: int = 1, timeout: float = 8.0,
                  runs_root: Any = None) -> tuple[RankFailure, dict[int, str]]:
    """Run a pipeline that infers its shapes (pipeline_shapes "inferred") with numpy unusable on rank `rank`, as
    if it were not installed there: shape inference sends each stage's output shapes as a pickled object
    (send_object_list / recv_object_list, which read the received bytes through tensor.numpy()). Returns the
    RankFailure and {rank: what that rank reported}:  failure, saw = without_numpy()."""
    config = (config or lesson_config("GPipe", microbatches=4)).replace(pipeline_shapes="inferred")
    try:
        launch(_WithoutNumpy(rank), config=config, timeout=timeout, echo=False, progress=False, runs_root=runs_root,
               name=f"{config.name} rank {rank} without numpy")
    except RankFailure as failure:
        return failure, {s.rank: s.detail for s in failure.statuses}
    raise AssertionError(f"the pipeline with numpy unusable on rank {rank} finished: expected a failure")


def ranks_left(run_dir: Any) -> list[int]:
    """The pids of a run's ranks (meta.json records each attempt's) that are still running: [] once the launcher has
    stopped and reaped them all, as it must, even after a failure."""
    meta = json.loads(RunDir(run_dir).meta.read_text())
    pids = [pid for attempt in meta.get("attempts", []) for pid in attempt.get("pids", [])]
    return [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
