"""What the launcher reports: how each rank ended (RankStatus) and the failure that names the cause (RankFailure).

    try:
        labkit.launch(cfg)
    except labkit.RankFailure as failure:
        failure.rank, failure.step, failure.reason     # 1, 4, "raised"
        failure.traceback                             # the cause's traceback, in full
        failure.statuses                              # every rank: state, step, last recorded step, detail
        failure.run.df                                # what the ranks recorded before it

The message leads with the cause in full; every other rank gets one line, and a rank that only failed because its
peer did (its collective lost the connection) is said to have stopped for that reason. Their full text stays in
their logs (runs/<id>/rank<r>.log).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..records import Run
from ..rundir import RunDir


class LaunchError(RuntimeError):
    """The launch could not start (bad arguments, or fork asked for while CUDA is initialised)."""


@dataclass
class RankStatus:
    """How one rank ended, as the watchdog saw it."""

    rank: int
    state: str                 # "ok" | "raised" | "signal" | "exited" | "hung" | "waiting" | "stopped"
    step: int                  # the step it was on
    recorded: int              # the last step it recorded
    detail: str = ""           # exception type and message, signal name, exit code, or where it hung
    traceback: str = ""        # Python traceback, faulthandler dump, or stack at the time of the hang
    time: float = field(default_factory=time.time)
    because_of: int | None = None  # the rank whose failure made this one stop (a lost connection, or labkit's stop)

    def line(self, cause: "RankStatus") -> str:
        """One line for the failure report: the cause briefly (its traceback follows), the others by their part."""
        where = f"at step {self.step} (last recorded step {self.recorded})"
        if self is cause:
            return f"rank {self.rank}: {self.state} {where}  <- the cause"
        if self.state == "stopped":
            return f"rank {self.rank}: stopped by labkit {where} after rank {cause.rank} failed"
        if self.because_of is not None:
            log = RunDir(".").log(self.rank).name   # the log's name, as RunDir spells it; the report ends with the dir
            return (f"rank {self.rank}: stopped {where}, its peer rank {self.because_of} failed "
                    f"(it saw: {_first_line(self.detail, 90)}; full text in {log})")
        return f"rank {self.rank}: {self.state} {where}" + (f": {_first_line(self.detail)}" if self.detail else "")


class RankFailure(RuntimeError):
    """A rank failed; `.rank`, `.step`, `.reason`, `.traceback` say which, where and how; `.statuses` has all ranks."""

    def __init__(self, cause: RankStatus, statuses: list[RankStatus], run_dir: Path):
        self.rank, self.step, self.reason = cause.rank, cause.step, cause.state
        self.detail, self.traceback, self.statuses, self.run_dir = cause.detail, cause.traceback, statuses, run_dir
        self.last_recorded_step = cause.recorded
        self.noticed_at: float | None = None  # time.time() when the watchdog saw the failure (before its report)
        lines = [f"rank {cause.rank} {_verb(cause)} at step {cause.step}: {cause.detail}"]
        lines += ["  " + s.line(cause) for s in statuses]
        if cause.traceback:
            lines += [f"--- rank {cause.rank} traceback ---", cause.traceback.rstrip()]
        lines.append(f"records and logs: {run_dir}")
        super().__init__("\n".join(lines))

    def noticed(self, at: float) -> "RankFailure":
        """Set when the watchdog saw the failure (a rank's exit, or the timeout passing), before it waited for the
        peers and read the stacks that its report needs:  failure.noticed_at - started -> seconds to notice."""
        self.noticed_at = at
        return self

    @property
    def consequences(self) -> list[int]:
        """The ranks the report lists as failing because of the cause: a peer that saw its connection to the cause
        break (because_of), or one labkit stopped after the cause failed:  failure.consequences -> [0]."""
        return [s.rank for s in self.statuses
                if s.rank != self.rank and (s.because_of == self.rank or s.state == "stopped")]

    @property
    def run(self) -> Run:
        """What the ranks recorded before the failure."""
        return Run(self.run_dir)


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _verb(status: RankStatus) -> str:
    return {"raised": "raised", "signal": "was killed by a signal", "exited": "exited early",
            "hung": "made no progress"}.get(status.state, status.state)
