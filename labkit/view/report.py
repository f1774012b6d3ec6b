"""A run as a person reads it in a terminal (`python -m labkit show DIR`):

    print(describe_run(labkit.load_run("runs/job1")))    # what it was, its headline figures, how it ended
"""
from __future__ import annotations

import pandas as pd

from ..records import Run


def describe_run(run: Run) -> str:
    """What the run was, its headline figures, how it ended (the failure report when it failed)."""
    summary = run.summary()
    lines = [f"{run.name}  ({run.path})", f"world size {run.world_size}, {summary['steps']} steps recorded"]
    table = pd.Series(summary).drop("steps").map(lambda v: f"{v:.4g}")
    lines += ["", table.to_string(), ""]
    failure = run.failure()
    lines.append(failure if failure else "finished: every rank ended cleanly" if run.finished else
                 "no failure on record, but the run did not record an end (still running, or killed with its launcher)")
    return "\n".join(lines)
