"""The control panel's table of past runs: one row per run, a tick box to draw it in the side-by-side figure.

    table = RunTable(Path("runs"), past="session", on_tick=redraw)
    table.refresh(tick=run.path)       # read the runs folder again; tick a run (the one just made)
    table.ticked()                     # the ticked runs' directories, oldest first

`past="session"` lists the runs this process launched (a lesson's own runs), "all" every run in the folder.
Only runs of a RunConfig are listed (they have a loss to compare), the newest `limit` of them.
"""
from __future__ import annotations

import html
import math
import os
from pathlib import Path
from typing import Any, Callable

from ..records import BadRunFile, Run, read_meta
from ..rundir import RunDir

PAST = ("session", "all")


class RunTable:
    """Rows of past runs with tick boxes; see the module docstring."""

    def __init__(self, root: Path, *, past: str = "session", on_tick: Callable[[], None] = lambda: None,
                 limit: int = 10):
        import ipywidgets
        if past not in PAST:
            raise ValueError(f"past = {past!r}: must be one of {', '.join(PAST)}")
        self.root, self.past, self.on_tick, self.limit = Path(root), past, on_tick, limit
        self.boxes: dict[Path, Any] = {}
        self.rows = ipywidgets.VBox()
        self.widget = ipywidgets.VBox([ipywidgets.HTML("<b>Runs</b> (tick to draw them side by side)"), self.rows])
        self.refresh()

    def runs(self) -> list[Path]:
        """The run directories listed: newest last, at most `limit`."""
        if not self.root.is_dir():
            return []
        found = []
        for path in sorted(self.root.iterdir()):  # names start with the launch time
            try:
                meta = read_meta(path) if path.is_dir() else {}
            except BadRunFile:
                continue  # a damaged run is not one to tick; load_run(path) says what is wrong with it
            if RunDir(path).config.exists() and meta and (self.past == "all" or meta.get("pid") == os.getpid()):
                found.append(path)
        return found[-self.limit:]

    def refresh(self, tick: Path | None = None) -> None:
        import ipywidgets
        rows, boxes = [], {}
        for path in self.runs():
            old = self.boxes.get(path)
            box = ipywidgets.Checkbox(value=(old.value if old is not None else False) or path == tick, indent=False,
                                      description=read_meta(path).get("name", path.name),
                                      layout=ipywidgets.Layout(width="330px"))
            box.observe(lambda _: self.on_tick(), names="value")
            boxes[path] = box
            rows.append(ipywidgets.HBox([box, ipywidgets.HTML(row_text(path))]))
        self.boxes = boxes
        self.rows.children = rows or [ipywidgets.HTML("<i>no runs yet</i>")]

    def ticked(self) -> list[Path]:
        return [path for path, box in self.boxes.items() if box.value]


def row_text(path: Path) -> str:
    """One run in a line: its shape, how it ended, final loss and throughput."""
    run = Run(path)
    config, meta, summary = run.config, run.meta, run.summary()
    steps, loss, speed = summary["steps"], summary["final_loss"], summary["samples_per_s"]
    numbers = (f"loss {loss:.3f}" if not math.isnan(loss) else "no loss recorded") + \
        (f", {speed:.0f} samples/s" if not math.isnan(speed) else "")
    return (f"<code>{html.escape(config.task)} w{config.world_size} b{config.global_batch}"
            f" ×{config.grad_accum} · {steps}/{config.steps} steps · "
            f"{html.escape(meta.get('outcome', 'running'))} · {numbers}</code>")

