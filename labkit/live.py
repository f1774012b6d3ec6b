"""What the launcher shows while ranks run: their output, a progress line, and (optionally) the live figure.

Used by launch(); nothing here touches the ranks. In Jupyter the progress line and the figure update in place
(display handles); in a terminal the progress line is redrawn on stderr; elsewhere (pytest, CI) only the ranks'
output is echoed. Redrawing a figure costs CPU that the ranks would otherwise use, so `live` is off by default
and redraws at most once a second: keep it off for runs whose throughput you want to measure.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from .rank import Heartbeats

PROGRESS_EVERY_S = 0.25
PLOT_EVERY_S = 1.0


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class LiveView:
    """Echo rank output, show progress, redraw the live figure:  view.update(beats) ... view.close()."""

    def __init__(self, run_dir: Path, world_size: int, total_steps: int | None, *, echo: bool = True,
                 progress: bool = True, live: bool = False, compare_with: tuple[Any, ...] = ()):
        self.run_dir, self.world_size, self.total_steps = run_dir, world_size, total_steps
        self.echo, self.compare_with = echo, compare_with
        self.offsets = [0] * world_size
        self.partial = [""] * world_size
        self.notebook = in_notebook()
        self.progress = progress and (self.notebook or sys.stderr.isatty())
        self.live = live and self.notebook
        self.started = time.time()
        self._last_progress = self._last_plot = 0.0
        self._progress_handle = self._plot_handle = None
        self._beats: Heartbeats | None = None

    def update(self, beats: Heartbeats, force: bool = False) -> None:
        self._beats = beats
        now = time.time()
        if self.echo:
            self._echo()
        if self.progress and (force or now - self._last_progress >= PROGRESS_EVERY_S):
            self._last_progress = now
            self._show_progress(beats)
        if self.live and (force or now - self._last_plot >= PLOT_EVERY_S):
            self._last_plot = now
            self._show_plot()

    def mute(self) -> None:
        """Stop echoing rank output (the watchdog is about to ask ranks for stack dumps)."""
        if self.echo:
            self._echo()
        self.echo = False

    def close(self) -> None:
        if self._beats is not None:
            self.update(self._beats, force=True)
        elif self.echo:
            self._echo()
        if self.progress and not self.notebook:
            sys.stderr.write("\n")

    def _echo(self) -> None:
        for rank in range(self.world_size):
            path = self.run_dir / f"rank{rank}.log"
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
                print(f"[rank {rank}] {line}")

    def _progress_text(self, beats: Heartbeats) -> str:
        recorded = [beats.read(r)[3] + 1 for r in range(self.world_size)]
        done = min(recorded)
        elapsed = time.time() - self.started
        if self.total_steps:
            width = 30
            filled = int(width * done / self.total_steps)
            bar = "█" * filled + "·" * (width - filled)
            head = f"{self.run_dir.name}  {bar}  step {done}/{self.total_steps}"
        else:
            head = f"{self.run_dir.name}  steps recorded per rank: {recorded}"
        return f"{head}  {elapsed:5.1f} s"

    def _show_progress(self, beats: Heartbeats) -> None:
        text = self._progress_text(beats)
        if self.notebook:
            from IPython.display import display
            if self._progress_handle is None:
                self._progress_handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._progress_handle.update({"text/plain": text}, raw=True)
        else:
            sys.stderr.write("\r" + text)
            sys.stderr.flush()

    def _show_plot(self) -> None:
        from IPython.display import display
        from .plot import compare
        from .records import Run
        fig = compare([*self.compare_with, Run(self.run_dir)])
        if self._plot_handle is None:
            self._plot_handle = display(fig, display_id=True)
        else:
            self._plot_handle.update(fig)
