"""How far a launch has got: steps done over steps total, per rank, with the time left.

    bar = Progress("tinylm w2", total_steps=40, world_size=2)
    bar.update([11, 12])      # last step each rank recorded (-1 before its first)
    bar.close(ok=True)

In a notebook it is an ipywidgets bar with a line of text beside it; in a terminal a line redrawn on stderr;
elsewhere (pytest, CI logs) nothing. A run whose length is unknown (a plain function) shows steps per rank only.
A larger display (the control panel) takes the bar with `bar.widget()` and shows it itself; update() fills it in.
The estimate of the time left counts from the first recorded step, so the seconds spent starting the ranks do not
make the first steps look slow.
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
        self._bar = self._text = self._box = None
        self.text = ""

    def update(self, recorded: list[int]) -> None:
        done_per_rank = [step + 1 for step in recorded]
        done, now = min(done_per_rank), time.time()
        if self._first is None and done > 0:
            self._first = (done, now)
        self.text = self._describe(done, done_per_rank, now)
        if self.notebook or self._box is not None:
            self._draw_widget(done)
        elif self.terminal:
            sys.stderr.write("\r" + self.text)
            sys.stderr.flush()

    def close(self, ok: bool = True) -> None:
        if self._bar is not None:
            self._bar.bar_style = "success" if ok else "danger"
        if self.terminal:
            sys.stderr.write("\n")

    def _describe(self, done: int, per_rank: list[int], now: float) -> str:
        elapsed = f"{now - self.started:.1f} s"
        ranks = " · ".join(str(d) for d in per_rank)
        if not self.total:
            return f"{self.label}: steps per rank {ranks}, {elapsed}"
        eta = eta_seconds(done, self.total, *(self._first or (0, now)), now)
        left = "" if eta is None else f", about {eta:.1f} s left"
        return f"{self.label}: step {done}/{self.total} ({ranks} per rank), {elapsed}{left}"

    def widget(self) -> Any:
        """The bar and its text as one ipywidgets box, made once; the caller shows it (update() fills it in)."""
        if self._box is None:
            import ipywidgets
            self._bar = ipywidgets.IntProgress(value=0, min=0, max=self.total or 1,
                                               layout=ipywidgets.Layout(width="40%"))
            self._text = ipywidgets.HTML()
            self._box = ipywidgets.HBox([self._bar, self._text])
        return self._box

    def _draw_widget(self, done: int) -> None:
        if self._box is None:
            from IPython.display import display
            display(self.widget())
        self._bar.value = min(done, self.total) if self.total else 0
        self._text.value = f"<code>{self.text}</code>"
