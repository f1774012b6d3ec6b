"""A pipeline step as torch.profiler saw it: each rank's Chrome trace read back, drawn, and held against the
actions labkit timed.

    run = pp.run_pipeline(pp.lesson_config("Interleaved1F1B", microbatches=4, steps=6, profile_step=5))
    trace = pp.read_stage_trace(run.dir.trace(0))     # PipelineTrace: .actions, .messages, .receives
    pp.match_stage_trace(trace, pp.step_actions(run, 5)[0])   # (holds, measured)
    pp.trace_timeline(run)                            # every rank's trace on one axis, labkit's actions under it

What the trace holds, as torch 2.13 writes it (RunConfig.profile_step runs one step under torch.profiler):
- the schedules that run from an action list (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
  DualPipeV) wrap every action in a record_function named "PP:<action>": "PP:2F0" (stage 2's forward of
  microbatch 0), "PP:3B1", "PP:1I0" / "PP:1W0" (backward split into inputs and weights), "PP:0SEND_F1",
  "PP:2RECV_B0", "PP:0UNSHARD"; DualPipeV's paired actions are one event, "PP:(2F2;1B0)OVERLAP_F_B", whose parts
  run in the order written. A compute action's span includes waiting for the message it needs: torch posts the
  receive in a RECV action and waits for it inside the action that uses it;
- GPipe wraps each microbatch's forward and backward in "Forward i" / "Backward i" (receive, compute and send);
  it names no stage, so those rows have stage -1;
- Schedule1F1B labels nothing: its trace holds operators only, and read_stage_trace finds no actions in it;
- gloo's own "gloo:send" / "gloo:recv" events, from when the operation was posted until it completed, with the
  tensor's shape and dtype (hence its bytes: trace_events.py); the reader keeps the receives.
Times are seconds on the trace's clock ("ts" and "dur" are microseconds), which every process of a machine shares;
it is not time.perf_counter's, so labkit's actions are placed on it by one offset per rank (match_stage_trace).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from ..records import Run
from ..view import COLORS, new_figure, shown
from .trace_events import event_bytes

COMPUTE = ("F", "B", "I", "W")
MESSAGES = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
LABEL = re.compile(r"^PP:(\d+)([A-Z_]+?)(\d*)$")           # PP:2F0, PP:0SEND_F1, PP:0UNSHARD
PAIRED = re.compile(r"^PP:\((.+)\)OVERLAP_F_B$")           # PP:(2F2;1B0)OVERLAP_F_B
PART = re.compile(r"^(\d+)([FBIW])(\d+)$")
SINGLE = re.compile(r"^(Forward|Backward) (\d+)$")         # GPipe's labels
COLUMNS = ["label", "kind", "stage", "microbatch", "start_s", "end_s"]
KIND_COLORS = {"F": COLORS[0], "B": COLORS[1], "I": COLORS[3], "W": COLORS[2]}   # pipeline.timeline's too


def step_actions(run: Run, step: int) -> dict[int, list]:
    """{rank: its actions at `step`}, as recorded (pipetrace's rows):  step_actions(run, 5)[0]."""
    rows = run.df[run.df.step == step]
    return {int(r.rank): list(r.pp_actions) for r in rows.itertuples()}


@dataclass(frozen=True)
class PipelineTrace:
    """One rank's trace of a pipeline step (read_stage_trace): times in seconds on the trace's clock.
    actions: torch's compute actions in the order they ran (label, kind F/B/I/W, stage, microbatch, start_s, end_s;
    table() gives them in ms from the first);
    messages: torch's SEND_/RECV_ actions (same columns); receives: gloo's own receive events (start_s, end_s,
    bytes), from posted to completed."""

    path: Path
    rank: int
    actions: pd.DataFrame
    messages: pd.DataFrame
    receives: pd.DataFrame

    def table(self) -> pd.DataFrame:
        """The compute actions for a person: torch's label, kind, stage, microbatch, start_ms (from this trace's
        first action) and ms (how long torch's span lasted):  trace.table().head()."""
        rows = self.actions
        start = rows.start_s.min() if len(rows) else 0.0
        return rows.assign(start_ms=(rows.start_s - start) * 1e3, ms=(rows.end_s - rows.start_s) * 1e3)[
            ["label", "kind", "stage", "microbatch", "start_ms", "ms"]]


def read_stage_trace(path: str | Path) -> PipelineTrace:
    """Read the Chrome trace JSON a pipeline rank wrote under RunConfig.profile_step:  read_stage_trace(p).actions."""
    path = Path(path)
    data = json.loads(path.read_text())
    events = sorted((e for e in data.get("traceEvents", []) if e.get("ph") == "X"), key=lambda e: e["ts"])
    actions, messages = [], []
    for event in events:
        start, end = event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6
        name = event.get("name", "")
        paired, label, single = PAIRED.match(name), LABEL.match(name), SINGLE.match(name)
        if paired:   # its parts run one after the other inside it: each gets the pair's span, in order
            for part in paired.group(1).split(";"):
                stage, kind, mb = PART.match(part).groups()
                actions.append([name, kind, int(stage), int(mb), start, end])
        elif label and label.group(2) in COMPUTE + MESSAGES and label.group(3):
            stage, kind, mb = label.groups()
            (actions if kind in COMPUTE else messages).append([name, kind, int(stage), int(mb), start, end])
        elif single:
            actions.append([name, single.group(1)[0], -1, int(single.group(2)), start, end])
    rank = int(data.get("distributedInfo", {}).get("rank", -1))
    return PipelineTrace(path, rank, pd.DataFrame(actions, columns=COLUMNS), pd.DataFrame(messages, columns=COLUMNS),
                         _gloo(events, "gloo:recv"))


def _gloo(events: list[dict[str, Any]], name: str) -> pd.DataFrame:
    rows = [{"start_s": e["ts"] / 1e6, "end_s": (e["ts"] + e["dur"]) / 1e6, "bytes": event_bytes(e)}
            for e in events if e.get("name") == name]
    return pd.DataFrame(rows, columns=["start_s", "end_s", "bytes"])


def match_stage_trace(trace: PipelineTrace, actions: list[list], *, slack_s: float = 2e-4) -> tuple[bool, str]:
    """Whether the trace's compute actions are labkit's (`actions`: one rank's [kind, stage, microbatch, t0, t1,
    bytes] rows for the traced step, pp.step_actions(run, step)[rank]): the same actions in the same order, and one
    clock offset that puts every one of labkit's inside torch's span of it, to `slack_s`. Returns (holds, measured).

    The two clocks differ (time.perf_counter against the profiler's): by an offset, and by a rate of a few parts
    in ten thousand at most, since torch's profiler reads an approximate clock that it converts to wall time with a
    rate it measured at start (so one offset leaves labkit's actions drifting out of torch's spans as a long step
    goes on: a busy core stretches a step, and 0.2 ms of drift appeared over one). labkit's action must start no
    earlier than torch's span and end no later: for a rate r (|r| <= MAX_RATE), the offset must lie between
    max(torch start - (1 + r) labkit start) and min(torch end - (1 + r) labkit end). That room is concave in r, so
    the best r is found by ternary search. It holds when the room at the best r is not below -slack_s."""
    ours = sorted(actions, key=lambda a: a[3])
    theirs = trace.actions
    if theirs.empty:
        return False, (f"{trace.path.name} labels no pipeline actions (torch's Schedule1F1B records none; "
                       "GPipe and the action-list schedules do)")
    named = [(k, int(s), int(m)) for k, s, m in zip(theirs.kind, theirs.stage, theirs.microbatch)]
    if len(named) != len(ours):
        return False, f"the trace holds {len(named)} compute actions, labkit timed {len(ours)}"
    mine = [(a[0], a[1] if s >= 0 else -1, a[2]) for a, (_, s, _) in zip(ours, named)]   # GPipe's name no stage
    wrong = [i for i, (a, b) in enumerate(zip(named, mine)) if a != b]
    if wrong:
        i = wrong[0]
        return False, (f"{len(wrong)} of {len(named)} actions differ in order; the first, #{i}: "
                       f"{_name(named[i])} in the trace, {_name(mine[i])} in labkit's records")
    # GPipe computes the last stage's loss after its "Forward i" span, and labkit's F counts the loss: there only
    # the start is held inside (the end may run past by the loss's time)
    ends = [a[3] if s < 0 and a[0] == "F" else a[4] for s, a in zip(theirs.stage, ours)]
    rate, room = best_rate(list(theirs.start_s), list(theirs.end_s), [a[3] for a in ours], ends)
    said = f"{len(named)} actions on both, the same in the same order"
    if room < -slack_s:
        return False, f"{said}, but no one clock offset puts labkit's inside torch's spans (short by {-room * 1e3:.2f} ms)"
    spans = theirs.drop_duplicates(["label", "start_s"])   # DualPipeV's pair is one span for two actions
    inside = sum(a[4] - a[3] for a in ours) / sum(spans.end_s - spans.start_s)
    fit = f"{room * 1e3:.2f} ms of room" if room >= 0 else f"within {-room * 1e3:.2f} ms, {slack_s * 1e3:g} ms allowed"
    fit += f"; clock rates {rate * 1e6:+.0f} ppm apart" if abs(rate) >= 1e-6 else ""
    return True, f"{said}; each of labkit's inside torch's span (one offset, {fit}); " \
                 f"labkit's compute is {inside:.0%} of torch's spans"


MAX_RATE = 1e-3   # the largest rate at which the two clocks may part (1000 ppm; a few hundred were seen)


def best_rate(starts: list[float], ends: list[float], ours_start: list[float], ours_end: list[float],
              max_rate: float = MAX_RATE) -> tuple[float, float]:
    """(rate, room): the clock rate r in [-max_rate, max_rate] that leaves the most room for one offset putting
    every labkit span [ours_start, ours_end] inside torch's [starts, ends] by t -> offset + (1 + r) t, and that
    room in seconds (negative: short by that much). Times are taken from labkit's first start, so r turns on it."""
    t0 = min(ours_start)

    def room(rate: float) -> float:
        lowest = max(s - (1 + rate) * (a - t0) for s, a in zip(starts, ours_start))
        highest = min(e - (1 + rate) * (b - t0) for e, b in zip(ends, ours_end))
        return highest - lowest

    low, high = -max_rate, max_rate
    for _ in range(80):   # room(r) is a min of lines minus a max of lines: concave, so ternary search finds its top
        a, b = low + (high - low) / 3, high - (high - low) / 3
        low, high = (a, high) if room(a) < room(b) else (low, b)
    rate = (low + high) / 2
    return (0.0, room(0.0)) if room(0.0) >= room(rate) else (rate, room(rate))


def _name(action: tuple) -> str:
    kind, stage, mb = action
    return f"{kind}{mb}" + (f" of stage {stage}" if stage >= 0 else "")


def offset_s(trace: PipelineTrace, actions: list[list]) -> float:
    """The clock offset that places labkit's `actions` on the trace's clock: the smallest at which none of them
    starts before torch's span of it (match_stage_trace then checks that none ends after it either)."""
    ours = sorted(actions, key=lambda a: a[3])
    return max(s - a[3] for s, a in zip(trace.actions.start_s, ours))


@shown
def trace_timeline(run: Run, *, step: int | None = None, title: str = "") -> Figure:
    """The profiled step of a pipeline run (RunConfig.profile_step) from its traces: for each rank, torch's compute
    actions (F blue, B red, I orange, W green; "PP:" labels) and its SEND/RECV actions (grey ticks), gloo's
    receives from posted to completed, and under them labkit's own actions placed by one offset (offset_s). Torch's
    bars are named "<stage><kind><microbatch>" where they are wide enough."""
    step = run.config.profile_step if step is None else step
    if step is None:
        raise ValueError(f"run {run.dir.path.name} was not profiled: launch it with RunConfig(profile_step=...)")
    mine = step_actions(run, step)
    traces = {rank: read_stage_trace(run.dir.trace(rank)) for rank in sorted(mine)}
    if any(t.actions.empty for t in traces.values()):
        raise ValueError(f"the traces of {run.config.pipeline_schedule} label no pipeline actions (torch's "
                         "Schedule1F1B records none): profile GPipe or an action-list schedule, e.g. Interleaved1F1B")
    start = min(t.actions.start_s.min() for t in traces.values())
    fig = new_figure(figsize=(11, 1.2 + 1.5 * len(traces)))
    ax = fig.add_subplot(1, 1, 1)
    ticks = []
    width = max(t.actions.end_s.max() for t in traces.values()) - start
    for i, (rank, trace) in enumerate(traces.items()):
        y = 3.6 * i
        for row in trace.actions.itertuples():
            ax.broken_barh([((row.start_s - start) * 1e3, (row.end_s - row.start_s) * 1e3)], (y - 0.4, 0.8),
                           color=KIND_COLORS[row.kind], alpha=0.55, edgecolor="white")
            if row.end_s - row.start_s > 0.05 * width and row.stage >= 0:   # its name, where it fits
                ax.text((row.start_s + row.end_s - 2 * start) * 5e2, y, f"{row.stage}{row.kind}{row.microbatch}",
                        ha="center", va="center", fontsize=6)
        for row in trace.messages.itertuples():
            ax.plot([(row.start_s - start) * 1e3] * 2, [y - 0.45, y + 0.45], color="0.45", linewidth=0.8)
        for row in trace.receives.itertuples():
            ax.broken_barh([((row.start_s - start) * 1e3, (row.end_s - row.start_s) * 1e3)], (y + 0.75, 0.5),
                           color="0.6", edgecolor="white")
        shift = offset_s(trace, mine[rank])
        for kind, _, mb, t0, t1, _ in mine[rank]:
            ax.broken_barh([((t0 + shift - start) * 1e3, (t1 - t0) * 1e3)], (y + 1.6, 0.8), color=KIND_COLORS[kind],
                           edgecolor="white")
        ticks += [(y, f"rank {rank} · torch.profiler"), (y + 1.0, f"rank {rank} · gloo:recv"),
                  (y + 2.0, f"rank {rank} · labkit's records")]
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's first action (the trace's clock)")
    ax.plot([], [], color="0.45", linewidth=0.8, label="SEND / RECV posted")
    for kind in sorted(set().union(*(set(t.actions.kind) for t in traces.values()))):
        ax.bar(0, 0, color=KIND_COLORS[kind], label={"F": "forward", "B": "backward", "I": "backward (inputs)",
                                                     "W": "backward (weights)"}[kind])
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title or f"{run.config.pipeline_schedule}, step {step}: trace{'/'.join(map(str, traces))}.json "
                          "(pale: torch's spans, waits included) and labkit's records (solid)")
    ax.grid(alpha=0.3, axis="x")
    return fig
