"""Lesson 22's checks on watched runs (labkit.watch of a plain torchrun script), each named after its claim:

    watched_claims.line_of(plain_ddp, "dist.barrier()  # ...and")   # 'plain_ddp.py:60': where a line of a script is
    watched_claims.printed_losses(run)      # the losses the script printed itself, parsed from the job's output
    watched_claims.unwatched(command)       # the losses the same command prints run without labkit watch
    watched_claims.step_ids(run)            # {rank: [the steps it recorded]}
    watched_claims.collective_ids(run)      # rank, step, seq, op: each collective the Flight Recorder saw, per step
    monitor.loss_gap(a, b)                  # (lesson 11's) the largest loss difference per rank and step, inf if keys differ
    watched_claims.first_difference(a, b)   # the first step whose loss differs on some rank (None: none differs)
    watched_claims.reported_within(m, limit)   # gated: the hang was reported within `limit` s of the last step

A run here is a labkit Run (or a Metered whose value is one, for the gated checks); losses are compared per (rank,
step), a NaN equal to a NaN.
"""
from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..measure import above, below
from ..records import Run, read_meta
from ..run.watch import resolve, unwatched_environment
from .watched import arrivals
from ..rundir import RunDir

# Not anchored to whole lines: under PYTHONUNBUFFERED, print writes its text and its newline apart, so two ranks'
# lines can share one line of the job's output ("rank 0 step 5 loss 0.43rank 1 step 5 loss 0.49").
PRINTED = re.compile(r"rank (\d+) step (\d+) loss (nan|-?inf|[-+]?[0-9.]+(?:e[-+]?[0-9]+)?)")


def line_of(module: Any, text: str) -> str:
    """'file.py:N', the first line of `module`'s source holding `text` (as the Flight Recorder names a place)."""
    lines, start = inspect.getsourcelines(module)
    for number, line in enumerate(lines, start=max(start, 1)):
        if text in line:
            return f"{Path(inspect.getsourcefile(module)).name}:{number}"
    raise ValueError(f"{text!r} is not in {module.__name__}'s source")


def printed_losses(run: Run) -> pd.DataFrame:
    """rank, step, loss: the lines "rank R step S loss L" the script printed, read from the job's output."""
    return _parse(RunDir(run.path).job_output.read_text(errors="replace"))


def _parse(text: str) -> pd.DataFrame:
    rows = [(int(r), int(s), float(v)) for r, s, v in PRINTED.findall(text)]
    return pd.DataFrame(rows, columns=["rank", "step", "loss"]).sort_values(["rank", "step"], ignore_index=True)


def unwatched(command: Sequence[str], timeout: float = 120.0) -> pd.DataFrame:
    """rank, step, loss: the lines "rank R step S loss L" that `command` printed, run as it is, without labkit watch
    (no agent in its ranks), e.g. unwatched(["torchrun", "--nproc-per-node", "2", "plain_ddp.py"]). A command that
    fails raises RuntimeError with the end of its stderr."""
    done = subprocess.run(resolve(command), env=unwatched_environment(), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode} unwatched:\n{done.stderr[-2000:]}")
    return _parse(done.stdout)


def step_ids(run: Run) -> dict[int, list[int]]:
    """{rank: the optimizer steps it recorded, in order}."""
    return {int(r): sorted(int(s) for s in steps) for r, steps in run.df.groupby("rank")["step"]}


def collective_ids(run: Run) -> pd.DataFrame:
    """rank, step, seq, op: every collective each rank's Flight Recorder saw, by the step that recorded it (op as
    gloo names it: "all_reduce", "broadcast"...)."""
    return arrivals(run.df)[["rank", "step", "seq", "op"]]


def _losses(source: Run | pd.DataFrame) -> pd.Series:
    frame = source if isinstance(source, pd.DataFrame) else source.df
    return frame.set_index(["rank", "step"])["loss"].astype(float).sort_index()


def first_difference(a: Run | pd.DataFrame, b: Run | pd.DataFrame) -> int | None:
    """The first step at which some rank's loss in `a` differs from `b`'s (exactly; NaN equals NaN), over the steps
    both hold; None when every shared step agrees."""
    la, lb = _losses(a).align(_losses(b), join="inner")
    differ = ~((la == lb) | (la.isna() & lb.isna()))
    steps = sorted({step for (_, step), bad in differ.items() if bad})
    return steps[0] if steps else None


def steps_per_rank(run: Run) -> dict[int, int]:
    """How many optimizer steps each rank recorded."""
    return {int(r): int(n) for r, n in run.df.groupby("rank").size().items()}


def report_delay(run: Run) -> float:
    """Seconds from the last record any rank wrote to the end of the watched job (labkit's report and kill)."""
    return float(read_meta(run.path)["ended_at"] - run.df["time"].max())


def reported_within(measured: Any, limit: float) -> str:
    """Gated: the watched job (measured.value, a Run) ended within `limit` seconds of its last recorded step."""
    delay = report_delay(measured.value)
    assert below(delay, limit, "last step to report (s)"), \
        f"reported {delay:.1f} s after the last step (limit {limit:g} s)"
    return f"{delay:.1f} s after the last step (limit {limit:g} s)"


def median_lags(run: Any) -> dict[int, float]:
    """Each rank's median lag (s) behind the first arrival at the step's collectives, from step 1 on."""
    from .watched import watch_report
    lags = watch_report(run).lags
    return {int(r): float(v) for r, v in lags[lags["step"] >= 1].groupby("rank")["lag_s"].median().items()}


def straggler_named(measured: Any, rank: int) -> str:
    """Gated: the watch report names `rank`, alone, as the straggler."""
    from .watched import watch_report
    found = watch_report(measured.value).stragglers
    assert found == [rank], f"stragglers {found}"
    return f"stragglers {found}"


def late_by_the_sleep(measured: Any, rank: int, sleep_s: float) -> str:
    """Gated: `rank` reached the collectives about `sleep_s` late (over half of it), every other rank under a fifth."""
    lags = median_lags(measured.value)
    shown = ", ".join(f"rank {r} {v * 1000:.0f} ms" for r, v in lags.items())
    others = [v for r, v in lags.items() if r != rank]
    assert above(lags[rank], 0.5 * sleep_s, f"rank {rank}'s median lag (s)"), shown
    assert not others or below(max(others), 0.2 * sleep_s, "the other ranks' largest median lag (s)"), shown
    return shown


def everyone_slowed(measured: Any, sleep_s: float) -> str:
    """Gated: every rank's median step time (from step 1) is over half the sleep: the others wait for the slow one.
    Half: a rank that did not wait would step in a few ms, one that waits takes about the whole sleep, so the
    limit stands midway (as lesson 11's does); the sleep itself would be the very value a waiting rank measures,
    a limit its step time can fall just under when its own clock started during the sleeper's sleep."""
    df = measured.value.df
    steps = df[df["step"] >= 1].groupby("rank")["t_step"].median()
    shown = ", ".join(f"rank {r} {v * 1000:.0f} ms" for r, v in steps.items())
    assert above(steps.min(), 0.5 * sleep_s, "least median step time (s)"), shown
    return shown
