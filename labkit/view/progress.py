"""How far a launch has got: steps done over steps total, per rank, with the time left, drawn by tqdm.

    bar = Progress("tinylm w2", total_steps=40, world_size=2)
    bar.update([11, 12])      # last step each rank recorded (-1 before its first)
    bar.close(ok=True)

In a notebook it is tqdm's widget bar (tqdm.notebook); in a terminal tqdm's line redrawn on stderr; elsewhere
(pytest, CI logs) nothing. A run whose length is unknown (a plain function) shows steps per rank only. A larger
display (the control panel) takes the bar with `bar.widget()` and shows it itself; update() fills it in.
The rate, and so the time left, counts from the first recorded step, so the seconds spent starting the ranks do not
make the first steps look slow: the bar restarts its clock there with `initial` set to the steps already done
(tqdm's own rate is (n - initial) / elapsed with smoothing=0, the same as eta_seconds).
"""
from __future__ import annotations

import sys
import time
from typing import Any

from .show import in_notebook


def eta_seconds(done: int, total: int, first_done: int, first_at: float, now: float) -> float | None:
    """Seconds left at the rate seen since `first_at` (when `first_done` steps were done); None until there is one:
    eta_seconds(done=20, total=40, first_done=1, first_at=0.0, now=19.0) == 20.0."""
    if done >= total:
        return 0.0
    if done <= first_done or now <= first_at:
        return None
    return (total - done) * (now - first_at) / (done - first_done)


class Progress:
    """Steps done (the slowest rank's) over the total, with ETA; see the module docstring."""

    def __init__(self, label: str, total_steps: int | None, world_size: int, *, enabled: bool = True):
        self.label, self.total, self.world_size = label, total_steps, world_size
        self.notebook = enabled and in_notebook()
        self.terminal = enabled and not self.notebook and sys.stderr.isatty()
        self.started = time.time()
        self._first: tuple[int, float] | None = None  # (steps done, time) at the first recorded step
        self._tqdm: Any = None
        self.done = 0
        self.text = ""

    @property
    def bar(self) -> Any:
        """The ipywidgets progress bar inside tqdm's notebook widget (None in a terminal or before it is made)."""
        container = getattr(self._tqdm, "container", None)
        return None if container is None else container.children[1]

    def update(self, recorded: list[int]) -> None:
        done_per_rank = [step + 1 for step in recorded]
        done, now = min(done_per_rank), time.time()
        first = self._first is None and done > 0
        if first:
            self._first = (done, now)
        self.done = done
        self.text = self._describe(done, done_per_rank, now)
        # `is None`, never `or`: a tqdm bar's truth is its total, and bool() raises when the total is unknown
        bar = self._tqdm if self._tqdm is not None else self._make(display=True)
        if bar is None:
            return
        if first:  # the clock starts at the first recorded step, not at the launch
            bar.reset()
            bar.initial = bar.last_print_n = done
        bar.n = min(done, self.total) if self.total else done
        bar.set_postfix_str(f"per rank {' · '.join(str(d) for d in done_per_rank)}", refresh=False)
        bar.refresh()

    def close(self, ok: bool = True) -> None:
        bar = self._tqdm
        if bar is None:
            return
        widget = self.bar
        bar.close()  # tqdm colours a notebook bar: 'success' when it reached its total, 'danger' short of it
        if widget is not None:
            widget.bar_style = "success" if ok else "danger"

    def _describe(self, done: int, per_rank: list[int], now: float) -> str:
        elapsed = f"{now - self.started:.1f} s"
        ranks = " · ".join(str(d) for d in per_rank)
        if not self.total:
            return f"{self.label}: steps per rank {ranks}, {elapsed}"
        eta = eta_seconds(done, self.total, *(self._first or (0, now)), now)
        left = "" if eta is None else f", about {eta:.1f} s left"
        return f"{self.label}: step {done}/{self.total} ({ranks} per rank), {elapsed}{left}"

    def widget(self) -> Any:
        """tqdm's notebook bar as one ipywidgets box, made once; the caller shows it (update() fills it in)."""
        if self._tqdm is None:
            self._make(display=False)
        return self._tqdm.container

    def _make(self, display: bool) -> Any:
        """tqdm's bar for where it is shown: a notebook widget (shown now if `display`), a terminal line, or None."""
        options = dict(total=self.total, desc=self.label, unit="step", smoothing=0, leave=True)
        if self.notebook or not display:
            from tqdm.notebook import tqdm as notebook_bar
            self._tqdm = notebook_bar(display=display, **options)
        elif self.terminal:
            from tqdm.std import tqdm as terminal_bar
            self._tqdm = terminal_bar(file=sys.stderr, **options)
        return self._tqdm
