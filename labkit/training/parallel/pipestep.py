"""The pipeline strategy's step inside labkit's loop: data for the stages, the schedule, the first-step check, and
the record fields.

    step = PipelineStep(model, task, config, ctx)   # strategies.distribute builds it for strategy "pp"
    loss, extras, t_data, t_fwd_bwd, samples = step(None, task, ctx, config, scaler, i)   # the loop calls it

Record fields (on every rank, every step):
    loss         the mean over the microbatches on the rank of the last stage; None on the other ranks, which
                 never see it (Run.steps() averages the ranks that have one)
    samples      the replica's rows on the last stage's rank, 0 elsewhere: summed over ranks, each sample once
    pp_stages    the stages this rank holds
    pp_actions   what the stages computed, timed: [kind, stage, microbatch, t0, t1, bytes saved] (pipetrace.py)
    pp_check     on the first step with RunConfig.pipeline_check: the largest gradient error against the unsplit
                 model, relative (it raises PipelineGradientError above pipeline.CHECK_RTOL)
Collectives and point-to-point messages are counted at the dispatcher on the first steps (strategies.py):
n_send / bytes_send, n_recv / bytes_recv, and the all-reduces of the tied embedding and of the replicas.

A rank keeps what its stages are doing in <run dir>/pipeline<rank>.now (one short line, rewritten in place at
every action): a hang or an abort is then reported with the stage and the action each rank was in
(labkit.tricks.pipeline.where_stages_were).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from torch import nn

from ...rundir import RunDir
from ..tasks import make_task
from .pipeline import Pipeline, check_against_unsplit, reference_copy

NOW_BYTES = 96


def now_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` keeps the action its stages are in."""
    return RunDir(run_dir).pipeline_now(rank)


class PipelineStep:
    """This rank's share of a pipelined step (see the module docstring)."""

    def __init__(self, model: nn.Module, task: Any, config: Any, ctx: Any):
        self.pipe = Pipeline(model, config, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
        self.parts: nn.Module = self.pipe.parts
        self.task = make_task(config, self.pipe.replicas)   # each replica reads its own rows
        self.whole = make_task(config, 1) if config.pipeline_check else None
        self.reference = reference_copy(model) if config.pipeline_check else None
        if self.reference is not None and self.pipe.mesh.dims.tp > 1:   # the stages' blocks will be split: the
            from .tensor_parallel import linear_gpt2                     # reference gets the same nn.Linear layers
            linear_gpt2(self.reference)
        self.rank, self.device = ctx.rank, ctx.device
        stages = ", ".join(map(str, self.pipe.indices))
        self._now = NowFile(now_path(ctx.run_dir, ctx.rank), f"before the first action of stage(s) {stages}")
        self.pipe.trace.on_change = self._now.write
        self.pipe.trace.watch_loss(self.pipe.schedule)  # the loss is the last stage's compute too (pipetrace.py)

    def __call__(self, ddp: Any, task: Any, ctx: Any, config: Any, scaler: Any,
                 step: int) -> tuple[float | None, dict, float, float, int]:
        t0 = time.perf_counter()
        inputs, targets = self.task.batch(step, 0, self.pipe.replica)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        t1 = time.perf_counter()
        loss = self.pipe.run(inputs, targets)
        t2 = time.perf_counter()
        extras: dict[str, Any] = {"pp_stages": self.pipe.indices, "pp_actions": self.pipe.trace.take()}
        if self.reference is not None:
            whole_inputs, whole_targets = self.whole.batch(step, 0, 0)
            errors = check_against_unsplit(self.pipe, self.reference, whole_inputs.to(self.device),
                                           whole_targets.to(self.device))
            extras["pp_check"] = max(errors.values(), default=0.0)
            self.reference = None  # the first step only: afterwards the pipeline trains what it was checked to
        samples = len(inputs) if self.pipe.has_last else 0
        return loss, extras, t1 - t0, t2 - t1, samples


class NowFile:
    """One fixed-size line, rewritten in place (a pwrite of a few bytes: microseconds per action), for whoever
    reports a hang or an abort to read:  NowFile(path, "starting").write("in F3 of stage 1")."""

    def __init__(self, path: Path, first: str):
        self.fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        self.write(first)

    def write(self, text: str) -> None:
        data = text.encode()[:NOW_BYTES].ljust(NOW_BYTES)
        os.pwrite(self.fd, data, 0)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def read_now(path: Path) -> str:
    """The action a rank's stages were in, as the rank last wrote it ("" when it wrote nothing)."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


