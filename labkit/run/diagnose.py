"""Turning what the watchdog saw into a RankFailure: who failed first, at which step, and why.

Two situations:
- a rank exited with a non-zero code: read its error file (raised), its exit signal (segfault, kill) or its
  exit code, and tell the root cause from the consequences (a peer of a dead rank fails with
  "Connection closed by peer" a moment later: that rank is a victim, not the cause);
- ranks stopped making progress: ask every live rank for its Python stacks (faulthandler on SIGUSR1) and
  blame the rank stuck outside torch (a sleep, a loop, a missing collective) rather than the ranks waiting
  inside torch for it; if all wait inside torch (mismatched or uneven collectives), blame the one furthest behind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch

from .failure import RankFailure, RankStatus
from .rank import FINISHING, INITIALISING, Heartbeats
from .reaping import exit_code

STACK_DUMP_WAIT_S = 0.5  # after asking hung ranks for their stacks, how long to wait for the dumps

_TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
_PEER_FAILURE = re.compile(r"connection closed|connection reset|broken pipe|peer|socket|remote process|"
                           r"ProcessGroup|NCCL error|timed out", re.I)


def classify_exits(procs: list[Any], beats: Heartbeats, run_dir: Path, failed: list[int]) -> RankFailure:
    """The RankFailure for ranks that exited with a non-zero code."""
    statuses = [_exit_status(r, p, beats, run_dir) for r, p in enumerate(procs)]
    failures = [statuses[r] for r in failed] + [s for s in statuses if s.state in ("raised", "signal", "exited")
                                                 and s.rank not in failed]
    causes = [s for s in failures if not _is_consequence(s)] or failures
    cause = min(causes, key=lambda s: s.time)
    for status in failures:
        if status is not cause and _is_consequence(status):
            status.because_of = cause.rank
    return RankFailure(cause, statuses, run_dir)


def _exit_status(rank: int, proc: Any, beats: Heartbeats, run_dir: Path) -> RankStatus:
    _, step, _, recorded = beats.read(rank)
    code = exit_code(proc)
    if code is None:
        return RankStatus(rank, "stopped", step, recorded, "stopped by labkit after another rank failed")
    if code == 0:
        return RankStatus(rank, "ok", step, recorded)
    error_file = run_dir / f"rank{rank}.error.json"
    if code > 0 and error_file.exists():
        err = json.loads(error_file.read_text())
        return RankStatus(rank, "raised", err["step"], recorded, f"{err['type']}: {err['message']}",
                          err["traceback"], err["time"])
    log = _read(run_dir / f"rank{rank}.log")
    if code < 0:
        name = signal.Signals(-code).name
        return RankStatus(rank, "signal", step, recorded, f"{name} (signal {-code})", _fatal_part(log))
    return RankStatus(rank, "exited", step, recorded, f"exit code {code} without a Python exception",
                      _tail(log, 40))


def _is_consequence(status: RankStatus) -> bool:
    """A communication error raised because a peer died is a consequence, not a cause."""
    return status.state == "raised" and bool(_PEER_FAILURE.search(status.detail))


def diagnose_hang(procs: list[Any], beats: Heartbeats, run_dir: Path, timeout: float) -> RankFailure:
    """The RankFailure for ranks that stopped making progress: collect stacks, then pick the stuck rank."""
    # Only ranks that registered the stack-dump handler may be sent SIGUSR1: it would kill the others.
    alive = [r for r, p in enumerate(procs) if exit_code(p) is None and beats.read(r)[2] >= INITIALISING]
    stacks = _dump_stacks(procs, alive, run_dir)
    now, statuses = time.time(), []
    for rank, proc in enumerate(procs):
        beat, step, state, recorded = beats.read(rank)
        if exit_code(proc) is not None:
            statuses.append(_exit_status(rank, proc, beats, run_dir))
            continue
        path, where, stack = _main_thread_top(stacks.get(rank, ""))
        if state < INITIALISING:
            statuses.append(RankStatus(rank, "hung", step, recorded,
                                       f"still starting after {now - beat:.1f} s (importing, before labkit's code)",
                                       "", beat))
        elif state == FINISHING:
            statuses.append(RankStatus(rank, "waiting", step, recorded, "finished; waiting for the others", stack))
        elif path.startswith(_TORCH_DIR):
            statuses.append(RankStatus(rank, "waiting", step, recorded,
                                       f"waiting inside torch ({where}) for {now - beat:.1f} s", stack, beat))
        else:
            statuses.append(RankStatus(rank, "hung", step, recorded,
                                       f"no progress for {now - beat:.1f} s (timeout {timeout:g} s), "
                                       f"in {where or 'unknown code'}", stack, beat))
    stuck = [s for s in statuses if s.state == "hung"]
    if not stuck:  # everyone waits inside torch: blame the rank furthest behind
        stuck = [s for s in statuses if s.state == "waiting" and "finished" not in s.detail] or statuses
    cause = min(stuck, key=lambda s: (s.step, s.time))
    if cause.state == "waiting":
        cause.detail = (f"no progress for {time.time() - cause.time:.1f} s (timeout {timeout:g} s); "
                        + cause.detail + "; its peers never joined that collective")
    cause.state = "hung"
    return RankFailure(cause, statuses, run_dir)


def _dump_stacks(procs: list[Any], ranks: list[int], run_dir: Path) -> dict[int, str]:
    """Ask each rank for its Python stacks (faulthandler writes them to the rank's log); return the new text."""
    sizes = {r: _size(run_dir / f"rank{r}.log") for r in ranks}
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    dumps: dict[int, str] = {}
    while time.monotonic() < deadline and len(dumps) < len(ranks):
        for r in ranks:
            text = _read(run_dir / f"rank{r}.log")[sizes[r]:]
            if "most recent call first" in text and text.endswith("\n\n") or text.count("\n") > 200:
                dumps[r] = text
        time.sleep(0.02)
    for r in ranks:
        dumps.setdefault(r, _read(run_dir / f"rank{r}.log")[sizes[r]:])
    return dumps


def _main_thread_top(dump: str) -> tuple[str, str, str]:
    """(file, "file:line in function", stack text) of the innermost frame of the thread running the rank."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    for block in blocks:
        if "in rank_main" in block:
            frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
            if frames:
                path, line, func = frames[0]
                # Frames below rank_main are the launcher's own (fork/spawn machinery): not the user's business.
                mine = block[:block.index("in rank_main") + len("in rank_main")]
                return path, f"{_short(path)}:{line} in {func}", mine.strip()
    return "", "", dump.strip()


def _fatal_part(log: str) -> str:
    """faulthandler's report of a fatal signal: its headline and the rank's own thread, innermost frame first."""
    start = log.rfind("Fatal Python error")
    if start < 0:
        return _tail(log, 40)
    report = log[start:]
    _, _, stack = _main_thread_top(report)
    return report.splitlines()[0] + "\n\n" + stack


def _short(path: str) -> str:
    return path.replace(_TORCH_DIR, "torch/")


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _size(path: Path) -> int:
    return len(_read(path))
