"""Run a user's own command (torchrun, a framework's launcher, plain python) and watch its ranks from outside.

    from labkit.run.watch import supervise
    job = supervise(["torchrun", "--nproc-per-node", "2", "train.py"], run_dir, timeout=30)
    job.outcome        # "finished" | "failed" (the job ended non-zero) | "hung" (labkit ended it) | "killed"
    job.failure        # the RankFailure naming the cause (None when it finished), lesson 12's diagnosis
    job.code           # the command's own exit status

The ranks record themselves (training/agent.py, loaded by training/site/sitecustomize.py, which leads PYTHONPATH);
this side reads their beat files. A rank whose agent has said neither "done" nor made a step or issued a collective
for `timeout` seconds is hung: the watcher asks every rank for its Flight Recorder (watch.ask), asks for their
stacks (SIGUSR1: faulthandler, no ptrace), diagnoses with diagnose_hang (the same as a notebook launch), then ends
the whole job: the command's process group, every descendant (torchrun puts its workers in their own sessions),
SIGTERM then SIGKILL. Nothing is left running, whichever way the job ends.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..records import write_meta, write_outcome
from ..rundir import RunDir, rank_of
from ..training import agent
from .diagnose import main_thread_top, await_exits, classify_exits, diagnose_hang
from .failure import LaunchError, RankFailure

SITE_DIR = Path(agent.__file__).parent / "site"
POLL_S = 0.1
TERM_GRACE_S = 3.0   # after SIGTERM, how long the job's processes get before SIGKILL
FR_WAIT_S = 2.0      # after asking for the Flight Recorders, the longest wait for the dumps
VANISHED = ("killed from outside: it vanished without an exception, a clean exit or a fatal-signal report "
            "(SIGKILL: the OOM killer, a scheduler, kill -9)")
STARTUP_S = 60.0     # before its first step, the longest a rank may go without progress (imports, data, DDP setup)


class CommandNotFound(LaunchError):
    """The command to watch is not on PATH (torchrun missing from this environment, a typo)."""


@dataclass
class Job:
    """How a watched command ended (see the module docstring)."""

    run_dir: Path
    code: int
    outcome: str
    failure: RankFailure | None = None
    ranks: list[int] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class WatchedRank:
    """A rank of the watched job seen from outside (not our child): its pid and how it ended, for diagnose.py."""

    rank: int
    pid: int
    run_dir: RunDir

    def exit_code(self) -> int | None:
        """None while it runs; 0 when its agent said done, 1 when it left an error file, the signal faulthandler
        saw (an abort, a segfault) as -signal, else -SIGKILL (it vanished without a word: killed from outside)."""
        if _alive(self.pid):
            return None
        state = _read_beat(self.run_dir, self.rank)[2]
        if self.run_dir.error(self.rank).exists():
            return 1
        if state == agent.DONE:
            return 0
        log = _read(self.run_dir.log(self.rank))
        for said, sig in _FATAL.items():
            if f"Fatal Python error: {said}" in log:
                return -sig
        return -signal.SIGKILL

    def is_reaped(self) -> bool:
        return not _alive(self.pid)


_FATAL = {"Aborted": signal.SIGABRT, "Segmentation fault": signal.SIGSEGV, "Bus error": signal.SIGBUS,
          "Floating point exception": signal.SIGFPE}  # what faulthandler writes for each fatal signal


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


class FileBeats:
    """The agents' beat files, read like the launcher's shared heartbeat table (rank.Heartbeats.read)."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def read(self, rank: int) -> tuple[float, int, float, int]:
        beat, step, state, _, _ = _read_beat(self.run_dir, rank)
        return beat, int(step), state, int(step) - 1

    def world_size(self) -> int:
        """The job's world size as the ranks' agents saw it ($WORLD_SIZE), 0 before any has started."""
        return max((int(_read_beat(self.run_dir, rank_of(p))[4]) for p in self.run_dir.beats()), default=0)


def _read_beat(run_dir: RunDir, rank: int) -> tuple[float, float, float, float, float]:
    try:
        data = run_dir.beat(rank).read_bytes()
        return agent.BEAT.unpack(data[:agent.BEAT.size])
    except (OSError, ValueError, struct.error):  # not written yet, or cut short: nothing to say
        return time.time(), 0.0, 0.0, -1.0, 0.0


def _alive(pid: int) -> bool:
    """Running (a zombie has ended: its parent has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), read from /proc: torchrun's workers lead their own
    sessions, so a process group does not reach them."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def resolve(command: Sequence[str]) -> list[str]:
    """The command with its program found on PATH; CommandNotFound (one line) when it is not there."""
    if not command:
        raise LaunchError("nothing to watch: give the command after --, e.g. labkit watch -- torchrun ... train.py")
    program = command[0]
    found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    beside = Path(sys.executable).parent / program  # this Python's own scripts (a venv that was not activated)
    if not found and os.sep not in program and os.access(beside, os.X_OK):
        found = str(beside)
    if not found:
        hint = " (torchrun comes with torch: is this the environment torch is installed in?)" \
            if Path(program).name == "torchrun" else ""
        raise CommandNotFound(f"{program}: command not found on PATH{hint}")
    return [found, *command[1:]]


def environment(run_dir: RunDir) -> dict[str, str]:
    """The job's environment: labkit's sitecustomize first on PYTHONPATH, the run directory for the agents."""
    env = dict(os.environ)
    env.pop(agent.OWNER_ENV, None)
    # Only the folder holding sitecustomize: the job's Python finds labkit where it is installed (a Python without
    # it says so in one line per rank, and the job runs unwatched).
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env[agent.DIR_ENV] = str(run_dir.path.resolve())
    return env


def unwatched_environment() -> dict[str, str]:
    """This process's environment with labkit watch taken out: no sitecustomize of labkit's on PYTHONPATH and no run
    directory, so a job started with it runs as it would without labkit (no agent in its ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in (agent.DIR_ENV, agent.OWNER_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and Path(p).resolve() != SITE_DIR.resolve())
    return env


def check_timeouts(timeout: float, startup_timeout: float) -> None:
    """LaunchError (one line) unless both are seconds > 0."""
    for name, value in (("--timeout", timeout), ("--startup-timeout", startup_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise LaunchError(f"{name} {value!r}: give the seconds a rank may go without a step or a collective, > 0")


def supervise(command: Sequence[str], run_dir: RunDir, timeout: float, *, startup_timeout: float = STARTUP_S,
              output: Any = None, on_poll: Callable[[], None] | None = None) -> Job:
    """Run `command` with an agent in every rank, until it ends or hangs (see the module docstring). Before its
    first optimizer step a rank may go max(timeout, startup_timeout) without progress (imports, data, DDP's first
    broadcasts: seconds on a busy machine), after it `timeout`. `output`: a file for the command's stdout and
    stderr (None: this process's own); `on_poll`: called every POLL_S (a live view)."""
    check_timeouts(timeout, startup_timeout)
    argv = resolve(command)
    started = time.time()
    write_meta(run_dir.path, launched_at=started, name=Path(command[0]).name, start_method="watch",
               command=list(command))
    proc = subprocess.Popen(argv, env=environment(run_dir), start_new_session=True,
                            stdout=output, stderr=subprocess.STDOUT if output is not None else None)
    ranks: dict[int, WatchedRank] = {}
    exited_at: dict[int, float] = {}
    hung: list[int] = []
    try:
        while proc.poll() is None:
            _find_ranks(run_dir, ranks)
            now = time.time()
            for r, watched in ranks.items():
                if r not in exited_at and watched.exit_code() is not None:
                    exited_at[r] = now
            beats = FileBeats(run_dir)
            hung = [r for r in ranks if r not in exited_at and beats.read(r)[2] != agent.DONE
                    and now - beats.read(r)[0] > (timeout if beats.read(r)[1] >= 1 else max(timeout, startup_timeout))]
            if hung:
                break
            if on_poll:
                on_poll()
            time.sleep(POLL_S)
        _find_ranks(run_dir, ranks)
        procs = [ranks.get(r) or _gone(r, run_dir) for r in range(max(ranks, default=-1) + 1)]
        failure = None
        if hung:
            failure = _diagnose_hang(procs, run_dir, timeout)
        elif proc.returncode not in (0, None) and ranks:
            exited_at = await_exits(procs, exited_at)
            failed = [r for r in exited_at if procs[r].exit_code() not in (0, None)]
            exited_at = _first_by_torchrun(failed, exited_at, _read(run_dir.job_output))
            failed.sort(key=exited_at.get)
            if failed:
                failure = _explain(classify_exits(procs, FileBeats(run_dir), run_dir.path, failed, exited_at),
                                   run_dir)
    finally:
        end_job(proc, hard=bool(hung))
    code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    outcome = "hung" if hung else "finished" if code == 0 else \
        "killed" if failure is not None and failure.detail.startswith(VANISHED) else "failed"
    write_outcome(run_dir.path, None if outcome == "finished" else str(failure or f"exit status {code}"))
    write_meta(run_dir.path, **{**_meta(run_dir), "world_size": len(ranks), "exit_code": code})
    return Job(run_dir.path, code, outcome, failure, sorted(ranks), time.time() - started)


def torchrun_root_cause(output: str) -> int | None:
    """The rank torchrun's agent names as its "Root Cause (first observed failure)" in the summary it prints when a
    rank fails, or None (not torchrun, or no such summary):  torchrun_root_cause(job_output_text) -> 1."""
    found = re.search(r"Root Cause \(first observed failure\):.*?\n\s*rank\s*:\s*(\d+)", output, re.S)
    return int(found.group(1)) if found else None


def _first_by_torchrun(failed: list[int], exited_at: dict[int, float], output: str) -> dict[int, float]:
    """When labkit saw several ranks gone in the same poll (POLL_S apart at most), which went first is torchrun's to
    say: its agent saw each exit code, and it stops the other ranks (SIGTERM) only after the first failure. Without
    this, a rank killed from outside and the peer torchrun then terminated tied, and the lower rank was named (seen
    once in CI: rank 0 named for rank 1's SIGKILL)."""
    named = torchrun_root_cause(output)
    if named not in failed or len(failed) < 2:
        return exited_at
    first = min(exited_at[r] for r in failed)
    if exited_at[named] - first > POLL_S:
        return exited_at   # labkit saw it go later, by more than a poll: its own clock stands
    return {**exited_at, named: first - POLL_S / 10}


def _meta(run_dir: RunDir) -> dict[str, Any]:
    from ..records import read_meta
    return read_meta(run_dir.path)


def _find_ranks(run_dir: RunDir, ranks: dict[int, WatchedRank]) -> None:
    for path in run_dir.pidfiles():
        rank = rank_of(path)
        if rank not in ranks:
            try:
                ranks[rank] = WatchedRank(rank, int(path.read_text()), run_dir)
            except ValueError:
                continue  # written but not yet filled


def _gone(rank: int, run_dir: RunDir) -> WatchedRank:
    return WatchedRank(rank, -1, run_dir)  # a rank that never started its agent


def _diagnose_hang(procs: list[WatchedRank], run_dir: RunDir, timeout: float) -> RankFailure:
    """Every live rank dumps its Flight Recorder (its agent's thread), then its stacks (faulthandler); diagnose."""
    for old in run_dir.flight_records():
        old.unlink()
    run_dir.watch_request.write_text(str(time.time()))
    alive = [p for p in procs if p.exit_code() is None]
    deadline = time.monotonic() + FR_WAIT_S
    while time.monotonic() < deadline and not all(run_dir.flight_record(p.rank).exists() for p in alive):
        time.sleep(0.02)
    markers = {p.rank: _thread_marker(run_dir, p.rank) for p in procs}
    return diagnose_hang(procs, FileBeats(run_dir), run_dir.path, timeout, markers=markers)


def _explain(failure: RankFailure, run_dir: RunDir) -> RankFailure:
    """A watched rank that died by a signal: its stack from faulthandler's fatal report (the script's main thread),
    what the C++ runtime said (the job's output: "what(): ..." when one line says it), and for a rank that simply
    vanished, that it was killed from outside."""
    said = re.findall(r"what\(\):\s*(.+)", _read(run_dir.job_output))
    for status in failure.statuses:
        if status.state != "signal":
            continue
        log = _read(run_dir.log(status.rank))
        start = log.rfind("Fatal Python error")
        if start < 0:
            status.detail = VANISHED
            continue
        _, where, stack = main_thread_top(log[start:], _thread_marker(run_dir, status.rank))
        status.traceback = log[start:].splitlines()[0] + "\n\n" + stack.split("\nExtension modules:")[0].rstrip()
        status.detail = status.detail.split(":")[0] + (f" in {where}" if where else "") + \
            (f"; the runtime said: {said[0].strip()}" if len(said) == 1 else "")
    cause = next(s for s in failure.statuses if s.rank == failure.rank)
    return RankFailure(cause, failure.statuses, failure.run_dir)


def _thread_marker(run_dir: RunDir, rank: int) -> str:
    """The header faulthandler gives the script's main thread ("Thread 0x...", as the agent wrote it in the log)."""
    try:
        for line in run_dir.log(rank).read_text(errors="replace").splitlines():
            if line.startswith("labkit watch: main thread "):
                return line.rsplit(" ", 1)[1]
    except FileNotFoundError:
        pass
    return "Current thread"


def end_job(proc: subprocess.Popen, hard: bool = False) -> None:
    """Stop the command and everything it started: SIGTERM to all, SIGKILL to what is left after TERM_GRACE_S;
    `hard`: SIGKILL at once (a hung job, whose stacks and recorders are read already, has nothing left to save,
    and torchrun would answer SIGTERM with a traceback of its own)."""
    for sig in (signal.SIGKILL,) if hard else (signal.SIGTERM, signal.SIGKILL):
        family = descendants(proc.pid) + ([proc.pid] if proc.poll() is None else [])
        if not family:
            break
        for pid in family:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in family)):
            time.sleep(0.05)
    proc.wait()


def report_line(job: Job) -> str:
    """One line for the terminal: how the job ended and where its records are."""
    say = {"finished": "finished", "failed": f"failed (the command's exit status {job.code})",
           "hung": "hung: labkit ended it", "killed": "a rank was killed from outside"}[job.outcome]
    return f"labkit watch: the job {say} after {job.seconds:.1f} s; records in {job.run_dir}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m labkit watch -- COMMAND")
