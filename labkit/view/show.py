"""A figure helper's figure shows in a notebook exactly once, whether the cell assigns it or ends with it.

    @shown
    def my_plot(runs) -> Figure:
        fig = new_figure(figsize=(8, 4))
        ...
        return fig

    fig = my_plot(runs)        # in a notebook: drawn here, once, mid-cell or on the last line alike
    fig.savefig("runs.png")    # still a matplotlib Figure, for files and scripts

Jupyter shows a value only when it is a cell's last expression, so a helper whose figure is assigned would show
nothing, and a helper that displays its figure itself would show it twice when it is also the last expression.
`shown` displays the figure when the helper returns and remembers the cell it did so in; asked again in that same
cell (the last expression), the figure declines. In a later cell, `fig` alone shows it again, like any value.
Outside a notebook (scripts, pytest) nothing is displayed.
"""
from __future__ import annotations

import functools
import io
from typing import Any, Callable, TypeVar

from matplotlib.figure import Figure

F = TypeVar("F", bound=Callable[..., Any])
_cells_started = 0  # cells run since labkit hooked into this kernel: tells "the same cell" from "a later cell"


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not in a terminal IPython, a script or pytest)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class LabFigure(Figure):
    """A matplotlib Figure that a notebook shows at most once per cell (see the module docstring)."""

    _shown_in_cell: int | None = None

    def _ipython_display_(self) -> None:
        if self._shown_in_cell == _current_cell():
            return
        self._shown_in_cell = _current_cell()
        from IPython.display import display
        display({"image/png": png_bytes(self), "text/plain": f"<{self._title()}>"}, raw=True)

    def _title(self) -> str:
        title = self._suptitle.get_text() if self._suptitle is not None else ""
        return f"labkit figure: {title}" if title else "labkit figure"


def new_figure(**kwargs: Any) -> LabFigure:
    """A LabFigure, with constrained layout unless told otherwise:  fig = new_figure(figsize=(8, 4))."""
    kwargs.setdefault("layout", "constrained")
    return LabFigure(**kwargs)


def png_bytes(fig: Figure, dpi: int = 90) -> bytes:
    """The figure as PNG bytes (what the notebook shows, and what the live view redraws)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def show(fig: Figure) -> Figure:
    """Display `fig` now if this is a notebook (once per cell, see LabFigure); return it either way."""
    if in_notebook():
        if not isinstance(fig, LabFigure):
            fig.__class__ = LabFigure  # a plain Figure made elsewhere gains the show-once behaviour
        fig._ipython_display_()
    return fig


def shown(helper: F) -> F:
    """Decorator for a function that returns a Figure: the figure is shown (once) when the function returns."""
    @functools.wraps(helper)
    def showing(*args: Any, **kwargs: Any) -> Any:
        return show(helper(*args, **kwargs))
    return showing  # type: ignore[return-value]


def _current_cell() -> int:
    _count_cells()
    return _cells_started


def _count_cells() -> None:
    """Count cell executions with IPython's pre_run_cell event (hooked once per kernel)."""
    global _cells_started
    from IPython import get_ipython
    shell = get_ipython()
    if shell is None or getattr(shell, "_labkit_counts_cells", False):
        return

    def started(*_: Any) -> None:
        global _cells_started
        _cells_started += 1

    shell.events.register("pre_run_cell", started)
    shell._labkit_counts_cells = True
    _cells_started += 1  # the cell running now started before the hook existed
