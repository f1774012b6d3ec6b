"""What code inside a rank is handed, whoever started the rank (labkit's launcher or torchrun):

    def worker(ctx: RankContext):          # may be defined in a notebook cell
        for step in range(10):
            ...
            ctx.record(step, loss=loss.item())   # one JSON line in the rank's records, and a heartbeat
        return model.weight.sum().item()         # comes back as run.result(rank)

The launcher's watchdog counts a rank as making progress while it calls `ctx.record` or `ctx.heartbeat`; a long
stretch without either (longer than launch's `timeout`) is reported as a hang. In the base, not in run/ where it is
built (run/session.py), so that training/ can name the type it receives without importing the launcher.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from .config import RunConfig
from .records import RankRecorder


class Beats(Protocol):
    """Where a rank reports that it is alive (rank.py's Heartbeats, shared with labkit's watchdog)."""

    def beat(self, rank: int, step: int | None = None, state: float | None = None,
             recorded: int | None = None) -> None: ...


@dataclass
class RankContext:
    """What a launched function gets: who it is, where to write, and how to report progress."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    run_dir: Path
    config: RunConfig | None
    recorder: RankRecorder
    heartbeats: Beats | None = None
    step: int = -1
    """The step this rank is working on (set by heartbeat/record); failures are reported against it."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def heartbeat(self, step: int | None = None) -> None:
        """Tell the watchdog this rank is alive (and, optionally, which step it has started)."""
        if step is not None:
            self.step = step
        if self.heartbeats is not None:
            self.heartbeats.beat(self.rank, step=step)

    def record(self, step: int, **fields: Any) -> None:
        """Write one record for `step` (rank and wall time are added) and beat the heartbeat."""
        self.step = step
        self.recorder.write({"step": step, "time": time.time(), **fields})
        if self.heartbeats is not None:
            self.heartbeats.beat(self.rank, step=step, recorded=step)
