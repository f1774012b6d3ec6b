"""A control panel for runs: knobs for a RunConfig's fields, Run and Stop, a bar per run, the live side-by-side
figure, and the past runs, ticked to compare.

    panel = labkit.panel(cfg, fields=["world_size", "global_batch", "lr", "clip_norm", "faults"])
    panel                                      # the last line of a cell: shows it
    # a person moves the knobs and presses Run (or Stop); from code, the same:
    panel.controls["world_size"].widget.value = 1
    panel.run_button.click()                   # the run goes on in a thread: the kernel stays free for Stop
    run = panel.wait()                         # its Run (stopped and failed runs too: run.failure())

It is made of plain ipywidgets (menus, sliders, buttons, IntProgress, HTML, Image). It is an application, in a room
of its own above run/ (it starts launches in threads) and view/ (it draws with their figures and bars); it calls
labkit.launch as launch(config, stop=..., runs_root=..., name=..., timeout=..., max_restarts=..., echo=False,
progress=False). Its timeout is launch's default (60 s without a recorded step before a rank counts as hung): a
panel run is an ordinary launch, and the same knob values must end the same way from a cell and from the panel.

Why not ipywidgets.interact, and why this panel never stalls a headless run (jupyter/nbclient#312)
------------------------------------------------------------------------------------------------
A headless runner (nbclient, under nbmake and nbconvert) has no browser, so nbclient stands in for one widget
itself: the Output widget. Whenever a cell's output lands in an Output widget, nbclient's stand-in sends the
widget's new contents back to the kernel, as a comm message on the *shell* channel, while nbclient is waiting for
that cell's execute_reply on the very same channel. jupyter_client's Session.send does not send through the
asyncio socket the wait is parked on: it sends through a blocking shadow of the same libzmq socket. A libzmq send
first processes the socket's pending commands, and when the execute_reply has just arrived that swallows its
wake-up (the one event on the socket's ZMQ_FD that the event loop waits for); pyzmq's asyncio layer, bypassed,
never looks again. The reply then sits unread until the wait's own timeout fires and a last zero-timeout poll
finds it: the cell "hangs" for exactly the per-cell timeout (300 s under `make test`) and then passes; with no
timeout, forever. `interact` enters this race every time it runs: it calls your function inside an Output widget.

Measured while writing this panel (nbclient 0.11, jupyter_client 8.10, pyzmq 27.3, ipykernel 7.4, a 2-core
machine shared with other jobs; `python tools/stall_check.py cells`, a cell then a second cell, short timeouts):
an interact cell sat out its whole timeout in 32 of 330 runs (3 to 16 per hundred from batch to batch, most when
the machine was busy), a bare Output widget with one print inside in 2 of 180, plain widgets driven by a click
handler in none of 180. With nbclient patched (for the experiment only) to let the asyncio socket look at its
events again after that send, neither Output case stalled in 200 runs each.

So this panel has no Output widget: its figure is an Image widget's PNG, its words go into HTML widgets, and no
callback or thread prints or displays anything (launch runs with echo=False; the bar is view/progress.py's,
placed here). Every message of a cell then flows kernel to client on IOPub, and nbclient sends nothing back on
the shell channel (tests/test_panel.py counts). The run goes on in a thread, so a button's handler returns at once
(a browser can deliver Stop mid-run), and a cell that needs the result calls panel.wait(), bounded by launch's
watchdog.
"""
from __future__ import annotations

import contextvars
import html
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import ConfigError, RunConfig
from ..records import Run, read_jsonl, read_meta
from ..run.launch import LAUNCH_TIMEOUT_S, launch
from ..rundir import RunDir, runs_root as resolve_runs_root
from ..view.figures import compare_figure
from ..view.progress import Progress
from ..view.show import png_bytes
from .controls import Knob, config_from, describe, make_knobs
from .table import RunTable

FIELDS = ("world_size", "global_batch", "grad_accum", "steps", "precision", "lr", "schedule", "warmup_steps",
          "clip_norm", "strategy", "faults")
"""The knobs labkit.panel() shows when not told which: the issue's list (world size ... injected faults)."""

EVERY_TRICK = {
    "scale (00, 03)": ["task", "model_size", "world_size", "global_batch", "grad_accum", "steps", "seed"],
    "communication (02, 04)": ["no_sync", "precision", "comm_hook", "powersgd_rank", "bucket_cap_mb"],
    "data (05, 07, 08)": ["data_workers", "sample_cost_ms", "pin_memory", "persistent_workers", "prefetch_factor",
                          "eval_every", "deterministic"],
    "optimizer (09, 10)": ["optimizer", "lr", "schedule", "warmup_steps", "min_lr_ratio", "cycles", "clip_norm",
                           "plateau_patience", "plateau_factor", "plateau_per_rank"],
    "failures (09, 11, 12)": ["faults", "nan_policy", "memory_budget_mb"],
    "state (13, 14)": ["checkpoint_every", "checkpoint_format", "strategy"],
}
"""The playground's knobs (notebooks/15_playground.ipynb), one tab per family of tricks, with their lessons."""

PROGRESS_EVERY_S = 0.25


@dataclass
class Job:
    """One press of Run: the config it ran with, its bar, and how it ended."""

    number: int
    config: RunConfig
    name: str
    progress: Progress
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    run_dir: Path | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    @property
    def run(self) -> Run | None:
        return Run(self.run_dir) if self.run_dir is not None else None


class Panel:
    """Knobs, Run/Stop, bars, the live figure and the table of runs; see the module docstring."""

    def __init__(self, config: RunConfig, *, fields: Sequence[str] | Mapping[str, Sequence[str]] = FIELDS,
                 runs_root: str | Path | None = None, timeout: float = LAUNCH_TIMEOUT_S, past: str = "session", live_every_s: float | None = 2.0,
                 max_restarts: int = 0):
        import ipywidgets
        if not isinstance(config, RunConfig):
            raise TypeError(f"config = {config!r}: pass a RunConfig (the panel starts from its values)")
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"max_restarts = {max_restarts!r}: pass how many times a failed run restarts, >= 0")
        self.base, self.timeout, self.live_every_s = config, timeout, live_every_s
        self.max_restarts = max_restarts
        self.root = resolve_runs_root(runs_root)
        groups = dict(fields) if isinstance(fields, Mapping) else {"": list(fields)}
        self.controls: dict[str, Knob] = {}
        for names in groups.values():
            self.controls.update(make_knobs(config, names))
        self.jobs: list[Job] = []
        self._draw_lock = threading.Lock()
        self.run_button = ipywidgets.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = ipywidgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        self.status = ipywidgets.HTML(f"Set the knobs and press Run. Base: <code>{html.escape(config.label)}</code>")
        self.bars = ipywidgets.VBox()
        self.figure = ipywidgets.Image(format="png", layout=ipywidgets.Layout(width="100%", display="none"))
        self.table = RunTable(self.root, past=past, on_tick=lambda: self.redraw())
        self.widget = ipywidgets.VBox([self._knob_box(groups), ipywidgets.HBox([self.run_button, self.stop_button,
                                                                                self.status]),
                                       self.bars, self.figure, self.table.widget])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _knob_box(self, groups: dict[str, list[str]]) -> Any:
        import ipywidgets

        def grid(names: Sequence[str]) -> Any:
            return ipywidgets.GridBox([self.controls[n].widget for n in names],
                                      layout=ipywidgets.Layout(grid_template_columns="repeat(2, 360px)"))
        if list(groups) == [""]:
            return grid(groups[""])
        tabs = ipywidgets.Tab(children=[grid(names) for names in groups.values()])
        for i, title in enumerate(groups):
            tabs.set_title(i, title)
        return tabs

    # --- what the buttons do ------------------------------------------------------------------------------------

    def config(self) -> RunConfig:
        """The RunConfig the knobs describe now (ConfigError, naming each bad field, if it is not allowed)."""
        return config_from(self.base, self.controls)

    @property
    def running(self) -> Job | None:
        return next((job for job in self.jobs if not job.done.is_set()), None)

    def start(self) -> Job | None:
        """Run button: launch the knobs' config in a thread; None (and a word in the status line) if it cannot."""
        if self.running is not None:
            self._say(f"Run #{self.running.number} is going: wait for it, or Stop it.")
            return None
        try:
            config = self.config()
        except ConfigError as e:
            self._say("Not started: " + html.escape(str(e)).replace("\n", "<br>"), error=True)
            return None
        number = len(self.jobs) + 1
        name = f"#{number} {describe(config, self.base)}"[:60]
        job = Job(number, config, name, Progress(name, config.steps, config.world_size, enabled=False))
        self.jobs.append(job)
        self.bars.children = (job.progress.widget(), *self.bars.children)
        self.run_button.disabled, self.stop_button.disabled = True, False
        self._say(f"Run #{number} starting: <code>{html.escape(name)}</code>")
        # The thread carries this cell's context, so its widget updates belong to the cell (or click) that ran it.
        job.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._go, job), daemon=True,
                                      name=f"labkit-panel-run-{number}")
        job.thread.start()
        return job

    def stop(self) -> None:
        """Stop button: ask the running job's launch to stop its ranks (at its watchdog's next look)."""
        job = self.running
        if job is not None:
            job.stop.set()
            self._say(f"Stopping run #{job.number}...")

    def wait(self, timeout: float | None = None) -> Run | None:
        """Wait for the latest run to end; its Run (None if it never got a run directory). Raises TimeoutError if it
        is still going after `timeout` seconds."""
        if not self.jobs:
            return None
        job = self.jobs[-1]
        if not job.done.wait(timeout):
            raise TimeoutError(f"run #{job.number} still going after {timeout} s; panel.stop() ends it")
        job.thread.join()
        return job.run

    # --- the run's thread -----------------------------------------------------------------------------------------

    def _go(self, job: Job) -> None:
        before = set(self.root.iterdir()) if self.root.is_dir() else set()
        launched = threading.Event()
        follower = threading.Thread(target=contextvars.copy_context().run, args=(self._follow, job, before, launched),
                                    daemon=True)
        follower.start()
        try:
            run = launch(job.config, stop=job.stop.is_set, runs_root=self.root, name=job.name,
                              timeout=self.timeout, max_restarts=self.max_restarts, echo=False, progress=False)
            job.run_dir = run.path
        except Exception as e:  # a RankFailure (its run_dir holds the records) or a refusal before any rank started
            job.error = e
            job.run_dir = getattr(e, "run_dir", None) or job.run_dir
        finally:
            launched.set()
            follower.join()
            try:
                self._finish(job)
            finally:
                job.done.set()  # only now may Run start another: the buttons and the table are up to date

    def _follow(self, job: Job, before: set[Path], launched: threading.Event) -> None:
        """While the run goes: its bar four times a second, the live figure every live_every_s."""
        last_plot = time.monotonic()
        while not launched.wait(PROGRESS_EVERY_S):
            job.run_dir = job.run_dir or _find_run_dir(self.root, before, job.name)
            if job.run_dir is None:
                continue
            job.progress.update(recorded_steps(job.run_dir, job.config.world_size))
            if self.live_every_s is not None and time.monotonic() - last_plot >= self.live_every_s:
                last_plot = time.monotonic()
                self.redraw(live=job.run)

    def _finish(self, job: Job) -> None:
        run = job.run
        if run is not None:
            job.progress.update(recorded_steps(run.path, job.config.world_size))
            self.table.refresh(tick=run.path)
        job.progress.close(ok=job.error is None and _outcome(job) == "finished")
        self._say(_ending(job), error=job.error is not None)
        self.run_button.disabled, self.stop_button.disabled = False, True
        self.redraw()

    # --- what is shown --------------------------------------------------------------------------------------------

    def redraw(self, live: Run | None = None) -> None:
        """Draw the ticked runs (and `live`, the run going now) side by side in the figure."""
        runs = [Run(path) for path in self.table.ticked()]
        if live is not None and live.path not in self.table.ticked():
            runs.append(live)
        with self._draw_lock:
            if not runs:
                self.figure.layout.display = "none"
                return
            self.figure.value = png_bytes(compare_figure(runs, title="ticked runs" + (" (live)" if live else "")))
            self.figure.layout.display = None

    def _say(self, text: str, error: bool = False) -> None:
        self.status.value = f"<span style='color:#b00'>{text}</span>" if error else text


def recorded_steps(run_dir: Path, world_size: int) -> list[int]:
    """The last step each rank has recorded (-1 before its first), read from its records file."""
    out = []
    for rank in range(world_size):
        path = RunDir(run_dir).records(rank)
        records = read_jsonl(path) if path.exists() else []
        out.append(max((r.get("step", -1) for r in records), default=-1))
    return out


def _find_run_dir(root: Path, before: set[Path], name: str) -> Path | None:
    """The directory launch made for this job: new since it started, made by this process, under this name."""
    if not root.is_dir():
        return None
    for path in set(root.iterdir()) - before:
        meta = read_meta(path)
        if meta.get("name") == name and meta.get("pid") == os.getpid():
            return path
    return None


def _ending(job: Job) -> str:
    run, name = job.run, html.escape(job.name)
    if job.error is not None:
        first = html.escape(str(job.error).strip().splitlines()[0] if str(job.error).strip() else repr(job.error))
        return f"Run <code>{name}</code> failed: {first}"
    steps = len(run.steps()) if run is not None else 0
    if _outcome(job) == "stopped":
        return f"Run <code>{name}</code> stopped after {steps} of {job.config.steps} steps."
    summary = run.summary()
    return (f"Run <code>{name}</code> finished: final loss {summary['final_loss']:.3f}, "
            f"{summary['samples_per_s']:.0f} samples/s.")


def _outcome(job: Job) -> str | None:
    return read_meta(job.run_dir).get("outcome") if job.run_dir is not None else None
