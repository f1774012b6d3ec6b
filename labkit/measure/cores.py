"""The cores a measurement runs on: pin a block (and every rank it launches) to some cores, and meter who used them.

    with pinned_to(2), CpuMeter() as meter:       # the launcher and its forked ranks inherit the two cores
        run = labkit.launch(cfg)
    ours, others = meter.cores_busy(start, end)   # cores kept busy by us, and by every other program, on those cores

A speed comparison means something only if the cores were ours while it ran: other programs only ever take time
away, and unevenly. The meter watches the cores of this process's affinity mask, not the whole machine, so a busy
core that our ranks never run on does not count against a measurement.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator

import numpy as np
import psutil


def usable_cores() -> int:
    """CPU cores this process (and the ranks it forks) may run on: its affinity mask, which taskset, containers
    and lessons narrow, so it can be fewer than os.cpu_count():  usable_cores() -> 2."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def pinned_to(cores: int) -> Iterator[list[int]]:
    """Run the block on the first `cores` cores this process may use (forked ranks inherit the mask); yields them.

        with pinned_to(2) as used:   # used == [0, 1] on most machines
            run = labkit.launch(cfg)
    """
    allowed = sorted(os.sched_getaffinity(0))
    if not isinstance(cores, int) or isinstance(cores, bool) or not 1 <= cores <= len(allowed):
        raise ValueError(f"pinned_to({cores!r}): this process may use {len(allowed)} cores; ask for 1..{len(allowed)}")
    os.sched_setaffinity(0, allowed[:cores])
    try:
        yield allowed[:cores]
    finally:
        os.sched_setaffinity(0, allowed)


def pin_rank(rank: int) -> int:
    """Inside a rank: keep this process, every thread of it, on one core of its own, the rank-th of those it may use
    (wrapping round when there are fewer cores than ranks); returns the core.  pin_rank(ctx.rank) first thing in fn(ctx).

    pinned_to sets one mask for a whole block, which forked ranks inherit: they share those cores and the OS moves
    them about. A pipeline's bubble is the time a rank waits for its peer, which is only measured as such when each
    rank has a core to itself; this is the call that gives it one, made by each rank for itself. Every thread:
    the mask is a thread's, and by the time fn(ctx) runs the process group has started its own threads (gloo's
    send/receive loop and workers), which would otherwise keep the wider mask and run on a peer's core."""
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[rank % len(allowed)]
    for thread in _threads():
        try:
            os.sched_setaffinity(thread, [core])
        except OSError:  # a thread that ended since it was listed
            pass
    return core


def _threads() -> list[int]:
    """This process's thread ids (Linux lists them under /proc/self/task; elsewhere, the calling thread only)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


class CpuMeter:
    """CPU time used by this process and its descendants (launcher, ranks, DataLoader workers) and by everything else
    on the cores this process may use, sampled in a thread:

        with CpuMeter() as meter:            # inside pinned_to(2): watches those 2 cores
            run = labkit.launch(cfg)
        ours, others = meter.cores_busy(start, end)   # cores kept busy between two time.time() stamps
    """

    def __init__(self, interval_s: float = 0.025):
        self.interval_s, self.cores = interval_s, sorted(os.sched_getaffinity(0))
        self.samples: list[tuple[float, float, float]] = []   # (time, our CPU seconds, all CPU seconds on cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "CpuMeter":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()   # the block's last moments too, not only up to the last tick

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        # Each process of our tree counts its own CPU and that of the children it has reaped (children_user/system):
        # a worker that starts and ends between two samples (DataLoader workers restarted each epoch) still counts
        # as ours once its parent reaps it, and a zombie is still listed until then, so nothing is lost or counted
        # twice. A process reaped while we list the tree can be missed for one sample: the total never goes down.
        me, ours = psutil.Process(), 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                cpu = proc.cpu_times()
            except psutil.Error:
                continue
            ours += cpu.user + cpu.system + cpu.children_user + cpu.children_system
        if self.samples:
            ours = max(ours, self.samples[-1][1])
        per_core = psutil.cpu_times(percpu=True)
        busy = sum(c.user + c.nice + c.system + c.irq + c.softirq + c.steal
                   for i, c in enumerate(per_core) if i in self.cores)
        self.samples.append((time.time(), ours, busy))

    def cores_busy(self, start: float, end: float) -> tuple[float, float]:
        """(ours, others): mean cores kept busy between `start` and `end` (time.time() values) by this process and
        its descendants, and by everything else on the watched cores."""
        times, ours, every = np.array(self.samples).T
        mine = (np.interp(end, times, ours) - np.interp(start, times, ours)) / (end - start)
        total = (np.interp(end, times, every) - np.interp(start, times, every)) / (end - start)
        return float(mine), float(max(0.0, total - mine))


def others_now(cores: int, seconds: float = 1.0) -> float:
    """Cores that other programs keep busy on the first `cores` cores, watched for `seconds` while this process
    waits:  others_now(2) -> 0.04 on a quiet machine."""
    with pinned_to(cores), CpuMeter() as meter:
        start = time.time()
        time.sleep(seconds)
        end = time.time()
    return meter.cores_busy(start, end)[1]


def wait_for_quiet(cores: int, limit: float, timeout_s: float = 10.0, window_s: float = 1.0) -> float:
    """Watch the first `cores` cores in windows of `window_s` until other programs keep at most `limit` of them busy,
    or `timeout_s` has passed; the others' cores of the last window:  wait_for_quiet(2, limit=0.2) -> 0.05."""
    deadline = time.time() + timeout_s
    while True:
        others = others_now(cores, window_s)
        if others <= limit or time.time() + window_s > deadline:
            return others
