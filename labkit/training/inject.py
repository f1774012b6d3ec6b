"""Failures on purpose: what RunConfig(faults=(Fault(kind=..., rank=..., step=...),)) does on that rank and step.

    cfg = RunConfig(world_size=2, steps=10, faults=(Fault(kind="segfault", rank=1, step=3),))
    labkit.launch(cfg)   # -> RankFailure: rank 1 was killed by a signal at step 3: SIGSEGV
    slow = RunConfig(world_size=2, steps=10, faults=(Fault(kind="slow", rank=1, step=0, delay_s=0.02),))
    labkit.launch(slow)  # finishes; rank 1 is a straggler (labkit.tricks.monitor.stragglers names it)

    cfg = RunConfig(task="digits", faults=(Fault(kind="bad_batch", rank=1, step=5),))   # corrupt_batch
    labkit.launch(cfg)   # rank 1's step-5 batch has shuffled labels and inputs 1000x too large; the run goes on

Lessons use them to show what each failure looks like from the outside; tests use them to check the launcher.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Iterable

import torch

from ..fault import Fault


class InjectedFault(RuntimeError):
    """The exception a Fault(kind="raise") throws."""


def _matching(faults: Iterable[Fault], kind: str, rank: int, step: int) -> bool:
    return any(f.kind == kind and f.rank == rank and f.step == step for f in faults)


def inject(faults: Iterable[Fault], rank: int, step: int) -> None:
    """Carry out any raise / segfault / hang / exit fault scheduled for this rank at the start of this step, and
    lose the delay of any "slow" fault on this rank that has begun."""
    faults = tuple(faults)
    if not faults:
        return
    if _matching(faults, "raise", rank, step):
        raise InjectedFault(f"injected failure on rank {rank} at step {step}")
    if _matching(faults, "segfault", rank, step):
        os.kill(os.getpid(), signal.SIGSEGV)
    if _matching(faults, "exit", rank, step):
        os._exit(3)  # vanish without a traceback, as an OOM-killed or crashed process would
    if _matching(faults, "hang", rank, step):
        while True:  # a rank stuck in its own code; the others will wait for it in the next collective
            time.sleep(3600)
    delay = sum(f.delay_s for f in faults if f.kind == "slow" and f.rank == rank and step >= f.step)
    if delay:
        time.sleep(delay)  # a straggler: the others wait for it in this step's all-reduce


def clock_ahead(faults: Iterable[Fault], rank: int, step: int) -> float:
    """Seconds this rank's clock reads ahead at this step (a "clock" fault that has begun), else 0.0."""
    return sum(f.delay_s for f in faults if f.kind == "clock" and f.rank == rank and step >= f.step)


def nan_factor(faults: Iterable[Fault], rank: int, step: int) -> float:
    """NaN for a Fault(kind="nan") at this rank and step (the loss is multiplied by it), else 1.0."""
    return float("nan") if _matching(faults, "nan", rank, step) else 1.0


BAD_INPUT_SCALE = 1000.0  # a bad batch's float inputs are this many times too large (a missing normalisation)


def corrupt_batch(faults: Iterable[Fault], rank: int, step: int, inputs: torch.Tensor,
                  targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch a Fault(kind="bad_batch") on this rank and step turns it into, else the batch unchanged:
    its labels shuffled (every target of the batch, permuted: the tokens or classes no longer follow the inputs)
    and, where the inputs are floats (digits), the inputs scaled by BAD_INPUT_SCALE. Token ids cannot be scaled,
    so a tinylm bad batch is its shuffled labels only.  inputs, targets = corrupt_batch(cfg.faults, 1, 5, x, y)"""
    if not _matching(faults, "bad_batch", rank, step):
        return inputs, targets
    order = torch.randperm(targets.numel(), generator=torch.Generator().manual_seed(step))
    targets = targets.reshape(-1)[order].reshape(targets.shape)
    if inputs.is_floating_point():
        inputs = inputs * BAD_INPUT_SCALE
    return inputs, targets
