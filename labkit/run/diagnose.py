"""Turning what the watchdog saw into a RankFailure: who failed first, at which step, and why.

Two situations:
- a rank exited with a non-zero code: read its error file (raised), its exit signal (segfault, kill) or its
  exit code, and tell the root cause from the consequences (a peer of a dead rank fails with
  "Connection closed by peer" a moment later: that rank is a victim, not the cause);
- ranks stopped making progress: ask every live rank for its Python stacks (faulthandler on SIGUSR1) and
  blame the rank stuck outside torch (a sleep, a loop, a lock) rather than the ranks waiting inside torch for
  it. If all wait inside torch (mismatched or uneven collectives), group them by where they wait (step,
  collective, and the line that called it) and blame the odd one out, the rank in the smallest group (ties:
  the one furthest behind). With three or more ranks, a rank that called another collective, or called one
  alone, stands out; with two, a disagreement has no majority and the report shows both sides.
A rank killed by a signal is reported with what the C++ runtime said just before (gloo's size check, say).

Consequences take a moment to show. When a rank dies, its peers learn it from a closed connection, raise, write
their error files and exit: a few milliseconds on a quiet machine, a few hundred with a core kept busy by another
program. So once a rank has failed, the launcher waits for the others to exit (await_exits: until all have, at
most CONSEQUENCE_WAIT_S) before it reads how each ended; a fixed short pause here blamed nobody for rank 0's stop
in one run of five under load. A rank still running after that wait did not fail on its own: labkit stops it, and
the report says it stopped because of the cause (because_of), as it says of a peer that saw the lost connection.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sysconfig
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..rundir import RunDir
from .failure import RankFailure, RankStatus
from .rank import FINISHING, INITIALISING, Heartbeats
from .reaping import exit_code

CONSEQUENCE_WAIT_S = 2.0  # after a rank fails, the longest wait for its peers to fail too and say why
_RANK_THREAD = "in rank_main"  # the frame every rank's main thread runs under (rank.py)
STACK_DUMP_WAIT_S = 2.0  # after asking hung ranks for their stacks, the longest wait for the dumps (a busy machine)

_TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
_AGENT_FILE = str(Path(__file__).parents[1] / "training" / "agent.py")  # `labkit watch`'s wrapper of backward()
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_PEER_FAILURE = re.compile(r"connection closed|connection reset|broken pipe|peer|socket|remote process|"
                           r"ProcessGroup|NCCL error|timed out", re.I)


def await_exits(procs: list[Any], exited_at: dict[int, float], wait_s: float | None = None,
                poll_s: float = 0.005) -> dict[int, float]:
    """After a failure: wait until every rank has exited, or `wait_s` (default CONSEQUENCE_WAIT_S) has passed;
    returns when each rank was first seen exited (time.time()), from `exited_at` on:
    await_exits(procs, {1: time.time()})."""
    seen = dict(exited_at)
    deadline = time.monotonic() + (CONSEQUENCE_WAIT_S if wait_s is None else wait_s)
    while True:
        for rank, proc in enumerate(procs):
            if rank not in seen and exit_code(proc) is not None:
                seen[rank] = time.time()
        if len(seen) == len(procs) or time.monotonic() >= deadline:
            return seen
        time.sleep(poll_s)


def classify_exits(procs: list[Any], beats: Heartbeats, run_dir: Path, failed: list[int],
                   exited_at: dict[int, float] | None = None) -> RankFailure:
    """The RankFailure for ranks that exited with a non-zero code (`failed`: those seen first; `exited_at`: when
    each rank was seen exited, from await_exits)."""
    exited_at = exited_at or {}
    statuses = [_exit_status(r, p, beats, run_dir, exited_at.get(r)) for r, p in enumerate(procs)]
    failures = [statuses[r] for r in failed] + [s for s in statuses if s.state in ("raised", "signal", "exited")
                                                 and s.rank not in failed]
    causes = [s for s in failures if not _is_consequence(s)] or failures
    cause = min(causes, key=lambda s: s.time)
    for status in statuses:
        # A peer that lost its connection to the cause, or one still running when labkit stopped it: neither
        # failed on its own.
        if status is not cause and (_is_consequence(status) or status.state == "stopped"):
            status.because_of = cause.rank
    return RankFailure(cause, statuses, run_dir)


def _exit_status(rank: int, proc: Any, beats: Heartbeats, run_dir: Path, seen_at: float | None = None) -> RankStatus:
    """How rank `rank` ended; `seen_at`: when the watchdog first saw it exited (the time of a death by signal)."""
    _, step, _, recorded = beats.read(rank)
    code = exit_code(proc)
    seen_at = seen_at or time.time()
    if code is None:
        return RankStatus(rank, "stopped", step, recorded, "stopped by labkit after another rank failed")
    if code == 0:
        return RankStatus(rank, "ok", step, recorded, time=seen_at)
    error_file = RunDir(run_dir).error(rank)
    if code > 0 and error_file.exists():
        err = json.loads(error_file.read_text())
        return RankStatus(rank, "raised", err["step"], recorded, f"{err['type']}: {err['message']}",
                          err["traceback"], err["time"])
    log = _read(RunDir(run_dir).log(rank))
    if code < 0:
        name = signal.Signals(-code).name
        said = _abort_reason(log)
        return RankStatus(rank, "signal", step, recorded, f"{name} (signal {-code})" + (f": {said}" if said else ""),
                          _fatal_part(log), seen_at)
    return RankStatus(rank, "exited", step, recorded, f"exit code {code} without a Python exception",
                      _tail(log, 40), seen_at)


def _is_consequence(status: RankStatus) -> bool:
    """A communication error raised because a peer died is a consequence, not a cause."""
    return status.state == "raised" and bool(_PEER_FAILURE.search(status.detail))


def diagnose_hang(procs: list[Any], beats: Heartbeats, run_dir: Path, timeout: float,
                  markers: dict[int, str] | None = None) -> RankFailure:
    """The RankFailure for ranks that stopped making progress: collect stacks, then pick the stuck rank.
    `markers`: per rank, the text that finds its main thread in a stack dump (default: labkit's rank_main frame;
    `labkit watch` passes the thread's "0x..." id, since a user's script has no rank_main)."""
    markers = markers or {}
    # Only ranks that registered the stack-dump handler may be sent SIGUSR1: it would kill the others.
    alive = [r for r, p in enumerate(procs) if exit_code(p) is None and beats.read(r)[2] >= INITIALISING]
    stacks = _dump_stacks(procs, alive, run_dir, markers)
    now, statuses, places = time.time(), [], {}
    for rank, proc in enumerate(procs):
        beat, step, state, recorded = beats.read(rank)
        if exit_code(proc) is not None:
            statuses.append(_exit_status(rank, proc, beats, run_dir))
            continue
        path, where, stack = main_thread_top(stacks.get(rank, ""), markers.get(rank, _RANK_THREAD))
        caller, innermost = _caller(stack)
        if state < INITIALISING:
            statuses.append(RankStatus(rank, "hung", step, recorded,
                                       f"still starting after {now - beat:.1f} s (importing, before labkit's code)",
                                       "", beat))
        elif state == FINISHING:
            statuses.append(RankStatus(rank, "waiting", step, recorded, "finished; waiting for the others", stack))
        elif path.startswith(_TORCH_DIR):
            called = f", called at {caller}" if caller else ""
            places[rank] = (step, where, caller)
            statuses.append(RankStatus(rank, "waiting", step, recorded,
                                       f"waiting inside torch ({where}){called}, for {now - beat:.1f} s", stack,
                                       beat))
        else:
            called = f", called at {caller}" if caller and not innermost else ""
            statuses.append(RankStatus(rank, "hung", step, recorded,
                                       f"no progress for {now - beat:.1f} s (timeout {timeout:g} s), "
                                       f"in {where or 'unknown code'}{called}", stack, beat))
    stuck = [s for s in statuses if s.state == "hung"]
    cause = min(stuck, key=lambda s: (s.step, s.time)) if stuck else _odd_one_out(statuses, places)
    if cause.state == "waiting":
        cause.detail = (f"no progress for {time.time() - cause.time:.1f} s (timeout {timeout:g} s); "
                        + cause.detail + _why_this_one(cause, statuses, places))
    cause.state = "hung"
    return RankFailure(cause, statuses, run_dir)


def _odd_one_out(statuses: list[RankStatus], places: dict[int, tuple]) -> RankStatus:
    """Everyone waits inside torch: the rank alone in its place (smallest group), then the one furthest behind."""
    waiting = [s for s in statuses if s.rank in places] or statuses
    sizes = Counter(places.get(s.rank) for s in waiting)
    return min(waiting, key=lambda s: (sizes[places.get(s.rank)], s.step, s.time))


def _why_this_one(cause: RankStatus, statuses: list[RankStatus], places: dict[int, tuple]) -> str:
    """Why the report blames a rank that waits inside torch like the others: where the others are."""
    groups: dict[tuple, list[int]] = {}
    for s in statuses:
        if s.rank in places and places[s.rank] != places[cause.rank]:
            groups.setdefault(places[s.rank], []).append(s.rank)
    if not groups:
        return "; its peers never joined that collective"
    seen = "; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} at step {step} in {where}"
                     + (f" called at {caller}" if caller else "") for (step, where, caller), ranks in groups.items())
    alone = sum(place == places[cause.rank] for place in places.values())
    if alone < min(len(ranks) for ranks in groups.values()):
        return f"; the ranks wait in different places ({seen}): this rank is the odd one out"
    return (f"; the ranks wait in different places ({seen}), split with no odd one out: this is the one furthest "
            "behind (or the first to stop); compare the places")


def dump_is_whole(text: str, at_last_look: str | None, marker: str = _RANK_THREAD) -> bool:
    """Whether a rank's stack dump has been written out: dump_is_whole(log_text_now, log_text_a_moment_ago).
    faulthandler writes one thread after another, line by line, each block ending in a blank line, and the rank's
    own thread (the one in rank_main) usually comes last: a blank line at the end is not enough (a busy machine
    showed the watchdog a dump of the other threads only). Whole: the rank's thread is in it and nothing arrived
    since the last look."""
    return marker in text and text.endswith("\n") and text == at_last_look


def _dump_stacks(procs: list[Any], ranks: list[int], run_dir: Path, markers: dict[int, str]) -> dict[int, str]:
    """Ask each rank for its Python stacks (faulthandler writes them to the rank's log); return the new text."""
    sizes = {r: _size(RunDir(run_dir).log(r)) for r in ranks}
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    dumps: dict[int, str] = {}
    seen: dict[int, str] = {}
    while time.monotonic() < deadline and len(dumps) < len(ranks):
        for r in ranks:
            text = _read(RunDir(run_dir).log(r))[sizes[r]:]
            if dump_is_whole(text, seen.get(r), markers.get(r, _RANK_THREAD)):
                dumps[r] = text
            seen[r] = text
        time.sleep(0.02)
    for r in ranks:
        dumps.setdefault(r, _read(RunDir(run_dir).log(r))[sizes[r]:])
    return dumps


def main_thread_top(dump: str, marker: str = _RANK_THREAD) -> tuple[str, str, str]:
    """(file, "file:line in function", stack text) of the innermost frame of the thread running the rank: the
    thread whose block holds `marker` (labkit's rank_main frame, or a watched script's "0x..." thread id)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    for block in blocks:
        if marker in block:
            frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
            if frames:
                path, line, func = frames[0]
                # Frames below rank_main are the launcher's own (fork/spawn machinery): not the user's business.
                mine = block[:block.index(marker) + len(marker)] if marker == _RANK_THREAD else block
                return path, f"{_short(path)}:{line} in {func}", mine.strip()
    return "", "", dump.strip()


def _caller(stack: str) -> tuple[str, bool]:
    """("file:line in function" of the innermost frame outside torch and Python's standard library, whether that
    is the innermost frame of all): the line of the rank's own code that called into torch or the library."""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stack)
    for i, (path, line, func) in enumerate(frames):
        if is_users(path):
            return f"{Path(path).name}:{line} in {func}", i == 0
    return "", False


def is_users(path: str) -> bool:
    """Whether a frame's file is the user's code: not torch, not Python's standard library, not labkit watch's
    wrapper of backward() (a watched rank's stack passes through it):  is_users("/tmp/train.py") -> True."""
    return not (path.startswith(_TORCH_DIR) or _in_stdlib(path) or path == _AGENT_FILE)


def _in_stdlib(path: str) -> bool:
    # Packages installed without a virtualenv live under the standard library's folder; they are not it.
    return path.startswith(_STDLIB_DIR) and not any(d in path for d in ("site-packages", "dist-packages"))


def _abort_reason(log: str) -> str:
    """What the C++ runtime printed before it aborted the process (std::terminate's what(): line), if anything."""
    said = re.findall(r"what\(\):\s*(.+)", log[:max(log.rfind("Fatal Python error"), 0)])
    return re.sub(r"^\[[^\]]*\]\s*", "", said[-1]).strip() if said else ""


def _fatal_part(log: str) -> str:
    """faulthandler's report of a fatal signal: its headline and the rank's own thread, innermost frame first."""
    start = log.rfind("Fatal Python error")
    if start < 0:
        return _tail(log, 40)
    report = log[start:]
    _, _, stack = main_thread_top(report)
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
