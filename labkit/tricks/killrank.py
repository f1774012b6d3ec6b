"""Killing a rank from outside, mid-step, the way a node failure or the kernel's OOM killer does.

    with KillRank(rank=1, at_steps=[7]) as killer:     # watches the next run launch() makes (runs_root: where)
        labkit.launch(cfg)                             # -> RankFailure: rank 1 ... SIGKILL
    killer.kills       # [{"attempt": 0, "step": 7, "pid": 4242, "last_recorded": 6, ...}]

    with KillRank(rank=1, at_steps=[5, 9]):            # one kill per attempt: attempt 0 at step 5, 1 at 9
        run = labkit.launch(cfg, max_restarts=2)

    with KillRank(rank=1, at_steps=range(2, 12), run_dir=job_dir):     # a torchrun job writing to job_dir
        subprocess.run(["torchrun", "--max-restarts", "10", ...])

Nothing inside the rank cooperates: a thread in this process reads the rank's records as they are written, and when
attempt i has recorded step at_steps[i] - 1 it waits about half a step (so the rank is inside step at_steps[i]) and
sends SIGKILL to the process that holds rank<r>.jsonl open for appending (a DataLoader worker holding it by
inheritance is told apart by its parent). SIGKILL cannot be caught: no exception, no finally, no flush, exactly like
the real thing. The rank may be caught a step later than asked when steps are shorter than the watcher's reaction
time, or inside the checkpoint saved after step at_steps[i] - 1 when there is one; `kills` says what the watcher saw
(the step the launcher reports is the authority).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import psutil

from ..rundir import RunDir, runs_root as resolve_runs_root

POLL_S = 0.002


class KillRank:
    """SIGKILL rank `rank` once per attempt, attempt i inside step at_steps[i] (see the module docstring)."""

    def __init__(self, *, rank: int, at_steps: Iterable[int], run_dir: str | Path | None = None,
                 runs_root: str | Path | None = None, timeout_s: float = 600.0):
        if run_dir is not None and runs_root is not None:
            raise ValueError("pass run_dir (a known run directory) or runs_root (the next run made there), not both")
        if run_dir is None and runs_root is None:
            runs_root = resolve_runs_root()  # where launch() puts runs by default
        self.rank, self.at_steps = rank, [int(s) for s in at_steps]
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.runs_root = Path(runs_root) if runs_root is not None else None
        self.timeout_s = timeout_s
        self.kills: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="labkit-kill-rank", daemon=True)
        self._existing: set[Path] = set()

    def __enter__(self) -> "KillRank":
        if self.runs_root is not None:
            self.runs_root.mkdir(parents=True, exist_ok=True)
            self._existing = set(self.runs_root.iterdir())
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        run_dir = self._find_run(deadline)
        records = RunDir(run_dir).records(self.rank) if run_dir else None
        for attempt, step in enumerate(self.at_steps):
            seen = self._wait_for(records, attempt, step - 1, deadline) if records else None
            if seen is None:
                return
            time.sleep(min(0.5, 0.5 * _typical_step_s(seen)))
            pid = self._holder(records)
            if pid is None:
                return
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            self.kills.append({"attempt": attempt, "step": step, "pid": pid, "time": time.time(),
                               "last_recorded": seen[-1]["step"]})

    def _find_run(self, deadline: float) -> Path | None:
        while not self._stop.is_set() and time.monotonic() < deadline:
            if self.run_dir is not None:
                if self.run_dir.is_dir():
                    return self.run_dir
            else:
                new = [p for p in self.runs_root.iterdir() if p not in self._existing and p.is_dir()]
                if new:
                    return max(new, key=lambda p: p.stat().st_mtime)
            time.sleep(POLL_S)
        return None

    def _wait_for(self, records: Path, attempt: int, step: int, deadline: float) -> list[dict[str, Any]] | None:
        """Wait until `attempt` has recorded `step` (step -1: until its process is up); return its records."""
        offset, mine = 0, []
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                with open(records, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            complete = chunk[:chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if (row.get("attempt") or 0) == attempt:
                    mine.append(row)
            if (mine and mine[-1]["step"] >= step) or (step < 0 and self._holder(records, attempt_started=True)):
                return mine or [{"step": -1}]
            time.sleep(POLL_S)
        return None

    def _holder(self, records: Path, attempt_started: bool = False) -> int | None:
        """The pid of the rank process that has `records` open (not a worker that inherited the descriptor)."""
        target = str(records.resolve())
        holders = {}
        for proc in psutil.Process().children(recursive=True):
            try:
                # Opened for appending: the rank's recorder. A process forked while this watcher had the file open
                # for reading holds it too (fork copies descriptors), and must not be taken for the rank.
                if any(f.path == target and f.mode in ("a", "a+", "w", "r+") for f in proc.open_files()):
                    holders[proc.pid] = proc.ppid()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        ranks = [pid for pid, parent in holders.items() if parent not in holders]
        return ranks[0] if ranks else None


def _typical_step_s(rows: list[dict[str, Any]]) -> float:
    times = [r["t_step"] for r in rows[-5:] if isinstance(r.get("t_step"), (int, float))]
    return statistics.median(times) if times else 0.02
