"""The ranks as operating-system processes: their exit codes, signals to their process groups, reaping.

    code = exit_code(proc)            # None while it runs; never reaps it
    signal_groups(procs, SIGTERM)     # each rank's whole group: the rank and whatever it started
    reap(procs)                       # last: only now may the kernel hand their pids to new processes

Each rank leads its own process group (its pid is the group id), so one killpg reaches the rank and everything it
started: DataLoader workers, a user's subprocess. A pid, and so a group id, stays ours until the process is reaped;
after that the kernel may give it to a new process, which may lead a group of its own. So the launcher looks at
exit codes without reaping (waitid with WNOWAIT leaves an exited rank a zombie that still holds its pid), signals
the groups, and reaps only at the very end. Nothing is ever sent to a group whose leader has been reaped.

Ranks forked by labkit's warm process (run/warm.py, WarmRank) are its children, not ours: it keeps them as zombies
the same way and reports their exit codes, and reaps one only when asked (WarmRank.join), so the same holds.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

REAP_TIMEOUT_S = 5.0


def exit_code(proc: Any) -> int | None:
    """A multiprocessing Process's exit code (negative: killed by that signal), or None while it runs; unlike
    `proc.exitcode`, looking does not reap it."""
    if hasattr(proc, "exit_code"):  # a WarmRank: the warm process says
        return proc.exit_code()
    popen = proc._popen
    if popen is None:
        return None
    if popen.returncode is not None:  # reaped already (by join or exitcode)
        return popen.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.exitcode
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def is_reaped(proc: Any) -> bool:
    if hasattr(proc, "is_reaped"):  # a WarmRank
        return proc.is_reaped()
    return proc._popen is not None and proc._popen.returncode is not None


def signal_groups(procs: Sequence[Any], sig: int) -> None:
    """Send `sig` to the process group of every rank that has not been reaped (running, or exited and waiting)."""
    for proc in procs:
        if proc.pid is None or is_reaped(proc):
            continue  # its pid may belong to someone else now
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if exit_code(proc) is None:
            try:  # a rank that has not made its own group yet (still starting) is reached directly
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def reap(procs: Sequence[Any], timeout: float = REAP_TIMEOUT_S) -> None:
    """Collect every rank's exit status (after this, their pids are free for reuse)."""
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout)
