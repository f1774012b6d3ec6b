"""One DDP step under torch.profiler, saved as Chrome trace JSON, read back, drawn, and held against labkit's probe.

    traced = trace_step(OverlapDDP, warm=2)      # 2 gloo ranks: 2 warm steps, then one step profiled and probed
    traced.path(0)                               # runs/<run>/trace0.json: open it in chrome://tracing or Perfetto
    trace = read_trace(traced.path(0))           # Trace: .allreduces (one row per all-reduce), .spans (the phases)
    trace_timeline(trace, probe=traced.probe(0)) # drawn from the trace's own events, the probe's row under them
    match_trace(trace, traced.probe(0))          # (holds, measured): same all-reduces, same order, same bytes

What the trace holds, as torch 2.13 writes it on CPU with gloo: each `dist.all_reduce` call is a "c10d::allreduce_"
event on the calling thread (the launch; "Input Dims" gives the tensor's shape), and each all-reduce gloo runs is a
"gloo:all_reduce" event on one of gloo's worker threads (from when a worker took it up until it completed; "Input
type" gives the dtype, hence the bytes). The step's phases are labkit's own record_function spans (SPANS), so the
reader finds backward without guessing from autograd's event names. Times in the file are microseconds ("ts",
"dur"); the reader gives milliseconds from backward's start, as labkit's timeline does.

The rank side (trace_step) reuses the timing lesson's model and batches (speeds.tinylm_config): the same tiny GPT-2.
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from ..config import RunConfig
from ..records import Run
from ..run import launch
from ..rundir import RunDir
from ..training.tasks import make_task
from ..view import COLORS, new_figure, shown
from ..tricks.trace_events import event_bytes, event_dtype, event_elements
from .probe import CommProbe
from .speeds import _communication, tinylm_config

# The step's phases, as record_function spans in the trace (named so that no torch event shares the name).
SPANS = {"forward": "labkit: forward", "backward": "labkit: backward",
         "finish": "labkit: finish_gradient_synchronization", "optimizer": "labkit: optimizer.step"}
LAUNCH = "c10d::allreduce_"      # a dist.all_reduce call, on the calling thread
RUN = "gloo:all_reduce"          # gloo running one all-reduce, on a worker thread


# --- the ranks ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TracedStep:
    """What trace_step measured: the run, each rank's trace file, and the all-reduces labkit's probe saw."""

    run: Run

    def path(self, rank: int = 0) -> Path:
        """The rank's Chrome trace JSON:  traced.path(0) -> runs/<run>/trace0.json."""
        return self.run.dir.trace(rank)

    def probe(self, rank: int = 0) -> pd.DataFrame:
        """The probe's all-reduces of the traced step on `rank`, in launch order: bytes, start_ms, end_ms (from
        backward's start), and backward_ms, the length of backward."""
        row = self.run.df[self.run.df["rank"] == rank].iloc[-1]
        frame = pd.DataFrame(row.allreduces, columns=["bytes", "start_ms", "end_ms"])
        frame["backward_ms"] = row.t_backward * 1e3
        return frame


def trace_step(wrapper: Callable[[nn.Module], nn.Module], *, warm: int = 2, world_size: int = 2,
               model_size: str = "small", global_batch: int = 16, runs_root: Any = None,
               timeout: float = 120.0) -> TracedStep:
    """Train the tiny GPT-2 wrapped in `wrapper` on `world_size` gloo ranks for `warm` steps, then one step under
    torch.profiler (CPU, shapes recorded) with labkit's CommProbe open too. Each rank writes its Chrome trace to
    the run directory (RunDir.trace) and records what the probe saw:  trace_step(OverlapDDP).path(0)."""
    config = tinylm_config(world_size, model_size, global_batch)
    worker = functools.partial(_trace_rank, wrapper=wrapper, warm=warm, config=config)
    run = launch(worker, world_size=world_size, timeout=timeout, echo=False, progress=False, name="trace-step",
                 runs_root=runs_root)
    return TracedStep(run)


def _trace_rank(ctx: Any, wrapper: Callable[[nn.Module], nn.Module], warm: int, config: RunConfig) -> None:
    task = make_task(config, ctx.world_size)
    torch.manual_seed(config.seed)
    model = task.build_model()
    wrapped = wrapper(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)

    def step(index: int) -> tuple[float, float, float]:
        with record_function(SPANS["forward"]):
            loss, _ = task.loss(wrapped, *task.batch(index, 0, ctx.rank))
        with record_function(SPANS["backward"]):
            started = time.perf_counter()
            loss.backward()
            ended = time.perf_counter()
        with record_function(SPANS["finish"]):
            wrapped.finish_gradient_synchronization()
        with record_function(SPANS["optimizer"]):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item(), started, ended

    for index in range(warm):   # the first steps pay one-off costs (and torch's DDP regroups its buckets after one)
        step(index)
    with CommProbe() as probe, profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss, started, ended = step(warm)
    prof.export_chrome_trace(str(RunDir(ctx.run_dir).trace(ctx.rank)))
    timeline = _communication(probe.of(op="all_reduce"), started, ended)["timeline"]   # [start, end, bytes], s
    ctx.record(warm, loss=loss, t_backward=ended - started,
               allreduces=[[size, start * 1e3, end * 1e3] for start, end, size in timeline])


# --- reading a trace ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trace:
    """A trace file read back: allreduces (one row per all-reduce, in launch order) and spans (the step's phases
    and where each thread ran), times in ms from the start of backward."""

    path: Path
    allreduces: pd.DataFrame
    spans: pd.DataFrame

    @property
    def backward_ms(self) -> float:
        row = self.spans[self.spans.name == "backward"].iloc[0]
        return float(row.end_ms - row.start_ms)


def read_trace(path: str | Path) -> Trace:
    """Read a Chrome trace JSON that torch.profiler wrote around one step made by trace_step:  read_trace(p).

    allreduces: order, launch_ms (the dist.all_reduce call), run_start_ms and run_end_ms (gloo working on it),
    thread (gloo's worker), elements, dtype, bytes (NaN where the trace names no dtype). A launch is paired with
    the earliest unclaimed gloo run of the same element count; gloo takes work in launch order. A trace without
    launch events (a process group called directly) gives one row per gloo run, in the order they started.
    spans: name (forward, backward, finish, optimizer), start_ms, end_ms."""
    path = Path(path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    spans = {short: e for e in events for short, name in SPANS.items() if e.get("name") == name}
    if "backward" not in spans:
        raise ValueError(f"{path}: no {SPANS['backward']!r} span; read_trace reads traces of trace_step")
    origin = float(spans["backward"]["ts"])

    def ms(us: float) -> float:
        return (float(us) - origin) / 1e3

    span_rows = [{"name": short, "start_ms": ms(e["ts"]), "end_ms": ms(e["ts"] + e["dur"])}
                 for short, e in spans.items()]
    launches = sorted((e for e in events if e.get("name") == LAUNCH), key=lambda e: e["ts"])
    runs = sorted((e for e in events if e.get("name") == RUN), key=lambda e: e["ts"])
    free = list(runs)
    rows = []
    for order, event in enumerate(launches or runs):
        elements = event_elements(event)
        run = event if not launches else next((r for r in free if event_elements(r) == elements), None)
        if launches and run is not None:
            free.remove(run)
        dtype = event_dtype(run) if run else None
        rows.append({"order": order, "launch_ms": ms(event["ts"]) if launches else math.nan,
                     "run_start_ms": ms(run["ts"]) if run else math.nan,
                     "run_end_ms": ms(run["ts"] + run["dur"]) if run else math.nan,
                     "thread": run["tid"] if run else None, "elements": elements, "dtype": dtype,
                     "bytes": event_bytes(run) if run else math.nan})
    columns = ["order", "launch_ms", "run_start_ms", "run_end_ms", "thread", "elements", "dtype", "bytes"]
    return Trace(path, pd.DataFrame(rows, columns=columns), pd.DataFrame(span_rows, columns=["name", "start_ms",
                                                                                              "end_ms"]))


# --- the check ----------------------------------------------------------------------------------------------------

def match_trace(trace: Trace, probe: pd.DataFrame) -> tuple[bool, str]:
    """Whether the trace's all-reduces are the probe's (TracedStep.probe): as many, in the same order with the same
    bytes wherever the trace gives them, and as many launched while backward ran, each counted on its own clock.
    Returns (holds, what was measured):  match_trace(read_trace(traced.path(0)), traced.probe(0))."""
    rows = trace.allreduces
    traced, probed = list(rows["bytes"]), [int(b) for b in probe["bytes"]]
    if len(traced) != len(probed):
        return False, f"the trace holds {len(traced)} all-reduces, the probe saw {len(probed)}"
    sized = [i for i, b in enumerate(traced) if not math.isnan(b)]
    if not sized:
        return False, f"{len(traced)} all-reduces on both, but the trace gives no sizes to compare"
    wrong = [i for i in sized if int(traced[i]) != probed[i]]
    if wrong:
        i = wrong[0]
        return False, (f"{len(wrong)} of {len(sized)} all-reduces differ; the first, #{i}: {int(traced[i]):,} B in "
                       f"the trace, {probed[i]:,} B in the probe")
    said = (f"{len(traced)} all-reduces on both, the same bytes in the same order ({sum(probed) / 2**20:.2f} MiB"
            f"{'' if len(sized) == len(traced) else f'; {len(sized)} sized by the trace'})")
    if rows["launch_ms"].isna().any():   # no launch events to time: order and bytes are all there is to compare
        return True, said
    inside_trace = int((rows["launch_ms"] < trace.backward_ms).sum())
    inside_probe = int((probe["start_ms"] < probe["backward_ms"]).sum())
    return inside_trace == inside_probe, f"{said}; launched during backward: trace {inside_trace}, probe {inside_probe}"


# --- drawing ------------------------------------------------------------------------------------------------------

@shown
def trace_timeline(trace: Trace, probe: pd.DataFrame | None = None, title: str = "") -> Figure:
    """The traced step from the trace's own events: the phases on the training thread, each all-reduce's launch
    (dot) there, and each gloo run as a bar on its worker thread's row; `probe` (TracedStep.probe) adds labkit's
    probe underneath, launch to completion, on its own clock from backward's start."""
    workers = sorted(t for t in trace.allreduces.thread.dropna().unique())
    rows = ["training thread"] + [f"gloo worker {k}" for k in range(len(workers))]
    rows += ["labkit's probe"] if probe is not None else []
    fig = new_figure(figsize=(11, 0.6 * len(rows) + 1.5))
    ax = fig.subplots()
    shades = {"forward": "#e0e0e0", "backward": "#cfd8dc", "finish": "#ffcc80", "optimizer": "#c5e1a5"}
    names = {"finish": "finish_gradient_synchronization()", "optimizer": "optimizer.step()"}
    for span in trace.spans.itertuples():
        ax.barh(0, span.end_ms - span.start_ms, left=span.start_ms, height=0.7, color=shades.get(span.name, "#eee"),
                edgecolor="white", label=names.get(span.name, span.name))
    color = COLORS[0]
    launched = trace.allreduces.dropna(subset=["launch_ms"])
    ax.plot(launched.launch_ms, [0.0] * len(launched), "|", color=color, markersize=12, label="all_reduce launched")
    for event in trace.allreduces.dropna(subset=["run_start_ms"]).itertuples():
        y = 1 + workers.index(event.thread)
        ax.barh(y, event.run_end_ms - event.run_start_ms, left=event.run_start_ms, height=0.6, color=color,
                alpha=0.75, edgecolor="white", linewidth=0.6)   # white edges part back-to-back all-reduces
    if probe is not None:
        y = len(rows) - 1
        for k, event in enumerate(probe.itertuples()):
            level = y - 0.3 + 0.6 * (k + 0.5) / max(len(probe), 1)
            ax.plot([event.start_ms, event.end_ms], [level, level], color=COLORS[1], linewidth=0.6)
            ax.plot(event.start_ms, level, "o", color=COLORS[1], markersize=2.5)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms from the start of backward", title=title or f"{trace.path.name}: "
           f"{len(trace.allreduces)} all-reduces (bars: gloo running each one; ticks: launched)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
