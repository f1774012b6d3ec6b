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
import re
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

from ..run import RankFailure, launch
from .report import Report

# Frames in these folders are not the learner's: labkit's own package, torch, and Python's standard library (outside
# site-packages: a package installed without a virtualenv lives under it).
_LIBRARIES = (str(Path(__file__).resolve().parents[2] / "labkit") + os.sep,
              str(Path(torch.__file__).resolve().parent) + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
_TORCH_CALL = re.compile(r"waiting inside torch \([^)]* in (\w+)\)")


def is_learners(path: str) -> bool:
    """Whether a frame's file is the learner's code (a notebook cell, a script, a test): not labkit's package, not
    torch, not Python's standard library:  is_learners("/tmp/ipykernel_7/2841.py") -> True."""
    path = str(Path(path).resolve()) if path and not path.startswith("<") else path
    return not (path.startswith(_LIBRARIES) or (path.startswith(_STDLIB) and "-packages" not in path))


def learner_frame(stack: str) -> tuple[str, str]:
    """(function, "file:line in function") of the innermost frame of the learner's code in a faulthandler dump or
    a traceback's text, or ("", "") when no frame is the learner's. A dump lists the innermost frame first, a
    traceback last: both are read innermost first."""
    frames = _FRAME.findall(stack)
    if "Traceback (most recent call last)" in stack:
        frames = frames[::-1]
    for path, line, func in frames:
        if is_learners(path):
            return func, f"{Path(path).name}:{line} in {func}"
    return "", ""


@contextlib.contextmanager
def learner_part(ctx: Any, part: str, step: int = -1) -> Iterator[None]:
    """Run a piece of the learner's code; if it raises, note `part` and the exception for the checker."""
    try:
        yield
    except BaseException as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames)
                      if is_learners(f.filename)), "")
        error = {"part": part, "step": step, "type": type(exc).__name__, "message": str(exc), "where": where,
                 "time": time.time(), "rank": ctx.rank}
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
        rank = f"rank {error['rank']}: " if "rank" in error else ""
        report.add("runs", "fail", f"{rank}your {error['part']} raised {error['type']}{step(error)}: "
                                   f"{error['message']}" + (f" ({error['where']})" if error["where"] else ""),
                   part=error["part"])
    elif failure.reason == "hung":
        places = hang_places(failure)
        part = next((func for rank, (func, where, call) in sorted(places.items()) if func), "")
        said = "; ".join(f"rank {rank} waits in {call or 'its code'} at {where}" if where else
                         f"rank {rank} waits in {call or 'its code'} in the checker's own code, after your code "
                         "returned or before it was called"
                         for rank, (func, where, call) in sorted(places.items()))
        report.add("runs", "fail", f"rank {failure.rank} made no progress{step({'step': failure.step})}"
                                   + (f" ({said})" if said else f": {failure.detail}")
                                   + ". A collective that not every rank made (same ops, same order, same sizes on "
                                     "all ranks) waits forever." + (f" {hang_hint}" if hang_hint else ""),
                   part=part)
    else:
        func, where = learner_frame(failure.traceback)
        report.add("runs", "fail", f"rank {failure.rank} {failure.reason}{step({'step': failure.step})}"
                                   + (f" at your line {where}" if where else "") + f": {failure.detail}",
                   part=func)
    return report


def hang_places(failure: RankFailure) -> dict[int, tuple[str, str, str]]:
    """For each rank of a hung run whose stack was read: (the learner's function it is in, "file:line in function"
    of the learner's innermost frame, the torch call it waits in or "")."""
    places = {}
    for status in failure.statuses:
        if not status.traceback:
            continue
        func, where = learner_frame(status.traceback)
        call = _TORCH_CALL.search(status.detail)
        places[status.rank] = (func, where, call.group(1) if call else "")
    return places
