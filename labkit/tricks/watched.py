"""`labkit watch`: a user's own job run with an agent in every rank, and the report that concludes.

    run = labkit.watch(["torchrun", "--nproc-per-node", "2", "train.py"], timeout=10)   # prints the report
    report = labkit.watch_report(run)     # the same report, read back from the run directory
    report.outcome, report.cause_rank     # "hung", 0
    report.waiting[0]                     # Place(seq=9, op='barrier', sizes='[]', line='train.py:18 in <module>')
    report.odd                            # [0]: the rank waiting in a collective no other rank ever issued there
    report.nonfinite                      # NonFinite(rank=1, step=3, ...) or None
    report.lags                           # per rank and step: how late it reached the step's collectives (s)
    report.stragglers                     # ranks the others waited for, slowest first

    python -m labkit watch --timeout 30 -- torchrun --nproc-per-node 2 train.py    # the same from a terminal

Where each conclusion comes from (run/watch.py runs the job; training/agent.py records inside each rank):
- the hang: lesson 12's diagnosis (run/diagnose.py) on the stacks faulthandler dumped, and the Flight Recorder
  each rank dumped while alive: the collective each waits in (the newest it issued and has not finished). With
  two ranks a disagreement has no majority; then the odd one is the rank waiting in a collective (op and line)
  that no other rank ever issued: a collective under `if rank == 0` is new to rank 1's history, DDP's gradient
  all-reduce is not.
- non-finite values: the records, out of band (no collective added to the job): the first step at which some
  rank's loss or gradient norm was not finite, that rank (the lowest step, then the lowest rank), and what every
  rank had at that step.
- stragglers: when each rank created each collective (the Flight Recorder's time_created_ns, recorded per step;
  one host's clock): a rank's lag at a collective is its arrival minus the first arrival; its lag in a step, the
  largest over the step's collectives (after the late arrival the rest start together). The rank that arrives
  last is the one the others wait for; lesson 11's compute and wait split, without a heartbeat.
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from ..records import Run
from ..rundir import RunDir, runs_root
from ..run.failure import RankFailure
from ..run.watch import STARTUP_S, FileBeats, Job, check_timeouts, report_line, resolve, supervise
from .debugtools import first_divergence, flight_records

STRAGGLER_SHARE = 0.5   # a rank is a straggler when its median lag exceeds this share of its median step time...
STRAGGLER_MIN_S = 0.01  # ... and this many seconds (same-host clocks, scheduling jitter of a few ms)
REPORT = "watch.json"


@dataclass(frozen=True)
class Place:
    """A collective a rank issued, from its Flight Recorder: sequence number, op, tensor sizes, the user's line."""

    seq: int
    op: str
    sizes: str
    line: str


@dataclass(frozen=True)
class NonFinite:
    """The first rank and step whose loss or gradient norm was not finite, and every rank's values at that step."""

    rank: int
    step: int
    what: str                                  # "loss", "grad_norm" or "loss and grad_norm"
    at_step: dict[int, dict[str, float]]       # rank -> {"loss": ..., "grad_norm": ...} at that step
    sure: bool = True  # False: every rank's gradients went bad together and no rank's loss did (DDP averaged them
                       # inside backward, so the records cannot tell whose backward made them; `rank` is the lowest)


@dataclass
class WatchReport:
    """What `labkit watch` concluded about one job (see the module docstring)."""

    run_dir: Path
    outcome: str
    code: int
    cause_rank: int | None = None
    cause_step: int | None = None
    failure: str = ""
    waiting: dict[int, Place | None] = field(default_factory=dict)
    odd: list[int] = field(default_factory=list)
    nonfinite: NonFinite | None = None
    lags: pd.DataFrame = field(default_factory=pd.DataFrame)
    stragglers: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [self.failure.rstrip()] if self.failure else []
        if self.waiting:
            lines.append("collectives (the Flight Recorder of each rank, dumped while it waited):")
            for rank, place in sorted(self.waiting.items()):
                mark = "  <- the odd one out" if rank in self.odd else ""
                lines.append(f"  rank {rank}: " + (f"waits in collective #{place.seq} {place.op} {place.sizes}, "
                                                   f"issued at {place.line}" if place else
                                                   "waits in no collective") + mark)
        if self.nonfinite and not self.nonfinite.sure:
            lines.append(f"non-finite: every rank's gradients at step {self.nonfinite.step}, and no rank's loss: DDP "
                         "averages gradients inside backward, so the records cannot tell whose backward made them")
        elif self.nonfinite:
            n = self.nonfinite
            others = "; ".join(f"rank {r}: loss {v['loss']:.4g}, grad norm {v['grad_norm']:.4g}"
                               for r, v in sorted(n.at_step.items()) if r != n.rank)
            lines.append(f"non-finite: rank {n.rank} first, at step {n.step} ({n.what}); at that step " +
                         (others or "no other rank recorded"))
        if not self.lags.empty:
            median = self.lags.groupby("rank")["lag_s"].median()
            lines.append("arrival at the collectives, median lag behind the first rank per step: " +
                         ", ".join(f"rank {r} {v * 1000:.1f} ms" for r, v in median.items()) +
                         (f"; straggler: rank {', '.join(map(str, self.stragglers))}" if self.stragglers else
                          "; no straggler"))
        return "\n".join(lines)


def watch(command: Sequence[str], *, timeout: float = 30.0, startup_timeout: float = STARTUP_S,
          run_dir: str | Path | None = None, echo: bool = True, progress: bool = True, live: bool = False) -> Run:
    """Run `command` (a torchrun line, a script) with an agent in every rank; print the report; return the Run:
    labkit.watch(["torchrun", "--nproc-per-node", "2", "train.py"], timeout=10). timeout: seconds a rank may go
    without an optimizer step or a new collective; startup_timeout: the same before its first step. The job's
    output goes to the run directory (RunDir.job_output) and is echoed when `echo`; `labkit.watch_report(run)`
    reads the report back. progress / live: launch's progress bar and live figure (in Jupyter). A command that is
    not there, a run directory in use, a bad timeout: LaunchError."""
    command = [str(part) for part in command]
    resolve(command)  # a command that is not there is refused before a run directory is made for it
    check_timeouts(timeout, startup_timeout)
    target = RunDir.claim(run_dir) if run_dir else RunDir.new(runs_root(), "watch-" + Path(command[0]).name
                                                              if command else "watch")
    view = _View(target, echo=echo, progress=progress, live=live)
    with open(target.job_output, "wb") as out:
        job = supervise(command, target, timeout, startup_timeout=startup_timeout, output=out, on_poll=view.poll)
    view.close(job.outcome == "finished")
    report = conclude(job)
    print(report_line(job))
    if not job.ranks:
        print("labkit watch: no rank was recorded: no process of the command had $RANK set (torchrun sets it; a "
              "framework that launches its own ranks needs its labkit callback) with labkit's sitecustomize loaded "
              "(is PYTHONPATH overwritten by the command?)")
    text = str(report)
    if text:
        print(text)
    return Run(target.path)


def conclude(job: Job) -> WatchReport:
    """The report of a job that ended, written to the run directory (watch.json) and returned."""
    failure = job.failure
    if job.outcome == "hung" and failure is not None:
        failure = blame(failure, *waiting_places(flight_records(job.run_dir)))
    summary = {"outcome": job.outcome, "code": job.code,
               "cause_rank": failure.rank if failure else None, "cause_step": failure.step if failure else None,
               "failure": str(failure) if failure else ""}
    (Path(job.run_dir) / REPORT).write_text(json.dumps(summary, indent=2))
    return watch_report(job.run_dir)


def watch_report(run: Run | str | Path) -> WatchReport:
    """The report of a watched run, read back from its directory:  labkit.watch_report(run).odd -> [0]."""
    path = run.path if isinstance(run, Run) else Path(run)
    file = path / REPORT
    if not file.exists():
        raise FileNotFoundError(f"{path}: no {REPORT} here: was this run made by labkit watch, and has it ended?")
    summary = json.loads(file.read_text())
    report = WatchReport(path, **summary)
    records = Run(path).df if RunDir(path).holds_records() else pd.DataFrame()
    if report.outcome == "hung":
        report.waiting, report.odd = waiting_places(flight_records(path))
    report.nonfinite = first_nonfinite(records)
    report.lags = arrival_lags(records)
    report.stragglers = stragglers(report.lags, records)
    return report


def waiting_places(fr: pd.DataFrame) -> tuple[dict[int, Place | None], list[int]]:
    """Per rank, the collective it waits in (the newest it issued, not finished) and the odd ranks: those whose
    collective differs from the others' at the first disagreement (first_divergence), or, with no majority, whose
    (op, line) no other rank ever issued."""
    if fr.empty:
        return {}, []
    waiting: dict[int, Place | None] = {}
    for rank, mine in fr.groupby("rank"):
        pending = mine[~mine["done"]].sort_values("seq")
        row = pending.iloc[-1] if not pending.empty else None
        waiting[int(rank)] = Place(int(row.seq), row.op, row.sizes, row.line) if row is not None else None
    divergence = first_divergence(fr)
    odd = list(divergence.odd) if divergence else []
    if not odd:
        history = {int(r): set(zip(m["op"], m["line"])) for r, m in fr[fr["done"]].groupby("rank")}
        odd = [r for r, p in waiting.items() if p is not None and
               not any((p.op, p.line) in seen for other, seen in history.items() if other != r)]
        odd = odd if 0 < len(odd) < len(waiting) else []
    return waiting, sorted(odd)


def blame(failure: RankFailure, waiting: dict[int, Place | None], odd: list[int]) -> RankFailure:
    """The hang's cause, with the Flight Recorder's word: when the stacks left no odd one out (two ranks, each in
    a different collective) and the recorders name one rank, that rank is the cause, and the report says why."""
    place = waiting.get(odd[0]) if len(odd) == 1 else None
    if place is None or "no odd one out" not in failure.detail:
        return failure
    statuses = [replace(s) for s in failure.statuses]
    cause = next((s for s in statuses if s.rank == odd[0]), None)
    if cause is None:
        return failure
    for s in statuses:
        s.state = "waiting" if s.state == "hung" else s.state
        s.detail = s.detail.split("; the ranks wait in different places")[0].split("; ", 1)[-1] \
            if s.detail.startswith("no progress") else s.detail
    others = "; ".join(f"rank {r} waits in #{p.seq} {p.op} issued at {p.line}"
                       for r, p in sorted(waiting.items()) if r != odd[0] and p is not None)
    cause.state = "hung"
    said = re.match(r"no progress for [^;]*", failure.detail)
    cause.detail = (f"{said.group(0) if said else 'no progress'}; it waits in collective #{place.seq} {place.op} issued at "
                    f"{place.line}, a collective (op and line) that no other rank has ever issued: the odd one out"
                    + (f" ({others})" if others else ""))
    return RankFailure(cause, statuses, failure.run_dir)


def first_nonfinite(records: pd.DataFrame) -> NonFinite | None:
    """The first record whose loss or grad_norm is not finite (by step; at one step a rank whose own loss is bad
    before ranks that only received bad gradients from the all-reduce; then by rank); None when all were finite. A
    watched rank's own flags (loss_finite, grads_finite) are used where recorded: a step without backward() has
    no loss, which is not a NaN."""
    if records.empty or "step" not in records:
        return None
    parts = {column: _not_finite(records, column, flag)
             for column, flag in (("loss", "loss_finite"), ("grad_norm", "grads_finite")) if column in records}
    bad = pd.concat(parts.values(), axis=1).any(axis=1) if parts else pd.Series(False, index=records.index)
    if not bad.any():
        return None
    own = parts["loss"] if "loss" in parts else pd.Series(False, index=records.index)
    ranked = records[bad].assign(_own=~own[bad])  # at one step, a rank whose own loss is bad first (False < True)
    first = ranked.sort_values(["step", "_own", "rank"]).iloc[0]
    what = " and ".join(c for c, flags in parts.items() if flags.loc[first.name])
    step = int(first["step"])
    at = records[records["step"] == step]
    sure = "loss" in what or int(bad[at.index].sum()) < len(at)
    return NonFinite(int(first["rank"]), step, what,
                     {int(r["rank"]): {"loss": float(r.get("loss", math.nan)),
                                       "grad_norm": float(r.get("grad_norm", math.nan))} for _, r in at.iterrows()},
                     sure)


def _not_finite(records: pd.DataFrame, column: str, flag: str) -> pd.Series:
    if flag in records:
        return records[flag].eq(False)
    return ~np.isfinite(pd.to_numeric(records[column], errors="coerce").astype(float))


def arrivals(records: pd.DataFrame) -> pd.DataFrame:
    """Every collective each rank's Flight Recorder saw, one row each: rank, step (the step that recorded it), seq,
    op (as gloo names it: "all_reduce", "broadcast"...) and t (its arrival, in seconds)."""
    rows = [{"rank": int(r.rank), "step": int(r.step), "seq": int(a[0]), "op": str(a[1]).split(":")[-1],
             "t": a[2] / 1e9}
            for r in records.itertuples() if isinstance(getattr(r, "arrivals", None), list) for a in r.arrivals]
    return pd.DataFrame(rows, columns=["rank", "step", "seq", "op", "t"])


def arrival_lags(records: pd.DataFrame) -> pd.DataFrame:
    """Per rank and step, the largest over the step's collectives of (this rank's arrival - the first rank's), in
    seconds, from the recorded Flight Recorder times (columns rank, step, lag_s, collectives). The largest, not a
    mean: once the late rank arrives, the step's later collectives start together, so the lag shows at one of them."""
    times = arrivals(records)
    if times.empty:
        return pd.DataFrame(columns=["rank", "step", "lag_s", "collectives"])
    ranks = times["rank"].nunique()
    times = times[times.groupby("seq")["rank"].transform("nunique") == ranks]  # issued by every rank
    times["lag_s"] = times["t"] - times.groupby("seq")["t"].transform("min")
    out = times.groupby(["rank", "step"]).agg(lag_s=("lag_s", "max"), collectives=("seq", "count"))
    return out.reset_index()


def stragglers(lags: pd.DataFrame, records: pd.DataFrame, after: int = 1) -> list[int]:
    """The ranks whose median lag (from step `after` on) is over STRAGGLER_SHARE of their median step time and
    STRAGGLER_MIN_S: the ranks the others waited for, slowest first."""
    if lags.empty or len(lags["rank"].unique()) < 2:
        return []
    median = lags[lags["step"] >= after].groupby("rank")["lag_s"].median()
    steps = records[records["step"] >= after].groupby("rank")["t_step"].median()
    found = [int(r) for r, lag in median.items() if lag > STRAGGLER_MIN_S and lag > STRAGGLER_SHARE * steps.get(r, 0)]
    return sorted(found, key=lambda r: -median[r])


class _View:
    """While the job runs: its output echoed (what it wrote since the last look), and once the ranks' agents say
    how many ranks there are, launch's progress bar and (`live`) live figure over their records."""

    def __init__(self, run_dir: RunDir, *, echo: bool, progress: bool, live: bool):
        self.run_dir, self.echo, self.progress, self.live = run_dir, echo, progress, live
        self.at, self.view = 0, None
        self.beats = FileBeats(run_dir)

    def poll(self) -> None:
        if self.echo:
            self._echo()
        if self.view is None and (self.progress or self.live) and self.beats.world_size():
            from ..view.live import LiveView
            self.view = LiveView(self.run_dir.path, self.beats.world_size(), None, echo=False,
                                 progress=self.progress, live=self.live)
        if self.view is not None:
            self.view.update(self._recorded())

    def _recorded(self) -> list[int]:
        return [self.beats.read(r)[3] for r in range(self.view.world_size)]

    def close(self, ok: bool) -> None:
        self.poll()
        if self.view is not None:
            self.view.close(ok, self._recorded())

    def _echo(self) -> None:
        try:
            with open(self.run_dir.job_output, "rb") as f:
                f.seek(self.at)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        if end:
            sys.stdout.write(data[:end].decode(errors="replace"))
            sys.stdout.flush()
            self.at += end


def as_dict(report: WatchReport) -> dict[str, Any]:
    """The report as plain data (for JSON): lags left out."""
    out = {k: v for k, v in asdict(report).items() if k != "lags"}
    out["run_dir"] = str(report.run_dir)
    return out
