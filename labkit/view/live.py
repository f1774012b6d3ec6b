"""What the launcher shows while ranks run: their output, a progress bar, and (optionally) the live figure.

Used by launch(), which hands it the steps each rank has recorded; nothing here touches the ranks. In Jupyter
the bar (progress.py) and the figure update in place; in a terminal the progress line is redrawn on stderr;
elsewhere (pytest, CI) only the ranks' output is echoed. Redrawing a figure costs CPU that the ranks would
otherwise use, so `live` is off by default and redraws at most once a second: keep it off for runs whose
throughput you want to measure.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..records import FAILURE_MARKER, Run
from ..rundir import RunDir
from .figures import compare_figure
from .progress import Progress
from .show import in_notebook, png_bytes

PROGRESS_EVERY_S = 0.25
PLOT_EVERY_S = 1.0


class LiveView:
    """Echo rank output, show progress, redraw the live figure:  view.update(recorded) ... view.close().

    `recorded` is the last step each rank has recorded (-1 before its first record)."""

    def __init__(self, run_dir: Path, world_size: int, total_steps: int | None, *, echo: bool = True,
                 progress: bool = True, live: bool = False, compare_with: tuple[Any, ...] = ()):
        self.run_dir, self.world_size, self.total_steps = run_dir, world_size, total_steps
        self.echo, self.compare_with = echo, compare_with
        self.offsets = [0] * world_size
        self.partial = [""] * world_size
        self.failed = [False] * world_size  # a rank's failure text is not echoed: the launcher's report has it
        self.notebook = in_notebook()
        self.bar = Progress(run_dir.name, total_steps, world_size, enabled=progress)
        self.live = live and self.notebook
        self._last_progress = self._last_plot = 0.0
        self._plot_handle = None
        self._recorded: list[int] | None = None

    def update(self, recorded: list[int], force: bool = False) -> None:
        self._recorded = list(recorded)
        now = time.time()
        if self.echo:
            self._echo()
        if force or now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.bar.update(self._recorded)
        if self.live and (force or now - self._last_plot >= PLOT_EVERY_S):
            self._last_plot = now
            self._show_plot()

    def mute(self) -> None:
        """Stop echoing rank output (the watchdog is about to ask ranks for stack dumps)."""
        if self.echo:
            self._echo()
        self.echo = False

    def close(self, ok: bool = True, recorded: list[int] | None = None) -> None:
        """Show the final state (`recorded`: the steps the ranks had recorded when they ended) and end the bar."""
        if recorded is not None:
            self._recorded = list(recorded)
        if self._recorded is not None:
            self.update(self._recorded, force=True)
        elif self.echo:
            self._echo()
        self.bar.close(ok)

    def _echo(self) -> None:
        """Print what each rank wrote since the last look, prefixed by its rank, up to where it failed: the cause's
        traceback comes in the launcher's failure report, and a peer's echo of the failure ("connection closed")
        would only bury it; every rank's full text stays in its log."""
        for rank in range(self.world_size):
            if self.failed[rank]:
                continue
            path = RunDir(self.run_dir).log(rank)
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[rank])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            self.offsets[rank] += len(chunk)
            lines = (self.partial[rank] + chunk.decode(errors="replace")).split("\n")
            self.partial[rank] = lines.pop()  # keep an unfinished line for the next look
            for line in lines:
                if line.startswith((FAILURE_MARKER, "Fatal Python error")):
                    self.failed[rank] = True
                    break
                print(f"[rank {rank}] {line}")

    def _show_plot(self) -> None:
        from IPython.display import display
        image = {"image/png": png_bytes(compare_figure([*self.compare_with, Run(self.run_dir)]))}
        if self._plot_handle is None:
            self._plot_handle = display(image, raw=True, display_id=True)
        else:
            self._plot_handle.update(image, raw=True)
