"""When the learner's code raises, hangs or is not written yet: note which part, and say so in the report.

    with learner_part(ctx, "finish_gradient_synchronization", step):   # in a rank, around the learner's call
        wrapped.finish_gradient_synchronization()
    report_failure(report, failure)          # in the checker, for the RankFailure launch raised
    outcomes = run_checked(report, drive, world_size=2, timeout=30, name="check-x", runs_root=None)

A call into the learner's code that raises is written down (which part, which step, the exception, the learner's
line) in exercise_error<rank>.json of the run directory before the rank fails, so the checker can say "not written
yet" (NotImplementedError) or name the part that raised, instead of showing a bare traceback.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

from ..run import RankFailure, launch
from .report import Report

# Frames in these folders are not the learner's: labkit's own package, and torch.
_LIBRARIES = (str(Path(__file__).resolve().parents[2]) + os.sep, str(Path(torch.__file__).resolve().parent) + os.sep)


@contextlib.contextmanager
def learner_part(ctx: Any, part: str, step: int = -1) -> Iterator[None]:
    """Run a piece of the learner's code; if it raises, note `part` and the exception for the checker."""
    try:
        yield
    except BaseException as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(frames)
                      if not f.filename.startswith(_LIBRARIES)), "")
        error = {"part": part, "step": step, "type": type(exc).__name__, "message": str(exc), "where": where,
                 "time": time.time()}
        Path(ctx.run_dir, f"exercise_error{ctx.rank}.json").write_text(json.dumps(error))
        raise


def read_error(run_dir: Path) -> dict[str, Any] | None:
    """The first learner error any rank wrote down (NotImplementedError first: it is the reason, not a symptom)."""
    errors = [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("exercise_error*.json"))]
    errors.sort(key=lambda e: (e["type"] != "NotImplementedError", e["time"]))
    return errors[0] if errors else None


def run_checked(report: Report, drive: Any, *, world_size: int, timeout: float, name: str,
                runs_root: Any, hang_hint: str = "") -> list[Any] | None:
    """Launch a checker's `drive` function on `world_size` ranks and return what each rank returned, or None when a
    rank failed (the report then says which part of the learner's code raised, hung or is not written yet;
    `hang_hint`, the exercise's own likeliest cause of a hang, is added to a hang's line)."""
    try:
        run = launch(drive, world_size=world_size, timeout=timeout, echo=False, progress=False, name=name,
                     runs_root=runs_root)
    except RankFailure as failure:
        report_failure(report, failure, hang_hint)
        return None
    report.run_dir = run.path
    return [run.result(rank) for rank in range(world_size)]


def report_failure(report: Report, failure: RankFailure, hang_hint: str = "") -> Report:
    """A run that did not finish: say which part of the learner's code is missing, raised, or hung (and, for a hang,
    `hang_hint`: what most often causes one in this exercise)."""
    report.run_dir = failure.run_dir
    error = read_error(failure.run_dir)
    step = lambda e: f" at step {e['step']}" if e["step"] >= 0 else ""  # noqa: E731
    if error and error["type"] == "NotImplementedError":
        what = error["message"] if "not written yet" in error["message"] else \
            f"not written yet: {error['message'] or 'your ' + error['part']}"
        report.add("written", "missing", f"{what} (the {error['part']} raised NotImplementedError). Write it in "
                                         "the ✏️ cell and run the check again.")
    elif error:
        report.add("runs", "fail", f"your {error['part']} raised {error['type']}{step(error)}: {error['message']}"
                                   + (f" ({error['where']})" if error["where"] else ""))
    elif failure.reason == "hung":
        report.add("runs", "fail", f"rank {failure.rank} made no progress{step({'step': failure.step})}: "
                                   f"{failure.detail}. A collective that not every rank made (same ops, same "
                                   "order, same sizes on all ranks) waits forever." + (f" {hang_hint}" if hang_hint
                                                                                         else ""))
    else:
        report.add("runs", "fail", f"rank {failure.rank} {failure.reason}: {failure.detail}")
    return report
