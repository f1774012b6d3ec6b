"""Inside one rank that labkit's launcher started (fork or spawn): the heartbeats its watchdog reads, and the
set-up and tear-down around the launched function, on top of the rank session (session.py) that torchrun's ranks
share. RankContext, what the function receives, is session.py's.
"""
from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import RunConfig
from ..rundir import RunDir
from .session import JoinSpec, RankContext, join, leave, write_rank_error

LAUNCHER_POLL_S = 0.1  # how often a rank checks that its launcher is still alive

# Rank states in the shared heartbeat table. STARTING: created, maybe still importing (spawn);
# INITIALISING: ours from here on (stack dumps work), joining the process group; RUNNING: in the function.
STARTING, INITIALISING, RUNNING, FINISHING, DONE = 0.0, 0.5, 1.0, 2.0, 3.0
_FIELDS = 4  # per rank: last beat (unix time), current step, state, last recorded step


class Heartbeats:
    """A small table in shared memory, written by the ranks and read by the launcher's watchdog."""

    def __init__(self, array: Any, world_size: int):
        self.array, self.world_size = array, world_size

    @classmethod
    def create(cls, mp_context: Any, world_size: int) -> "Heartbeats":
        array = mp_context.RawArray("d", world_size * _FIELDS)
        for rank in range(world_size):
            array[rank * _FIELDS:(rank + 1) * _FIELDS] = [time.time(), -1.0, STARTING, -1.0]
        return cls(array, world_size)

    @classmethod
    def shared(cls, world_size: int, fd: int | None = None) -> tuple["Heartbeats", Any, int]:
        """The table and the rendezvous port in a memory file that a process not forked from this one can map
        (the warm process's ranks): (heartbeats, port, fd); pass `fd` to map an existing one (inside a rank)."""
        size = world_size * _FIELDS * ctypes.sizeof(ctypes.c_double) + ctypes.sizeof(ctypes.c_int)
        if fd is None:
            fd = os.memfd_create("labkit-heartbeats")
            os.ftruncate(fd, size)
            created = True
        else:
            created = False
        memory = mmap.mmap(fd, size)
        array = (ctypes.c_double * (world_size * _FIELDS)).from_buffer(memory)
        port = ctypes.c_int.from_buffer(memory, world_size * _FIELDS * ctypes.sizeof(ctypes.c_double))
        beats = cls(array, world_size)
        beats.memory = memory  # the arrays point into it: it must live as long as they do
        if created:
            for rank in range(world_size):
                array[rank * _FIELDS:(rank + 1) * _FIELDS] = [time.time(), -1.0, STARTING, -1.0]
        return beats, port, fd

    def beat(self, rank: int, step: int | None = None, state: float | None = None,
             recorded: int | None = None) -> None:
        base = rank * _FIELDS
        self.array[base] = time.time()
        if step is not None:
            self.array[base + 1] = step
        if state is not None:
            self.array[base + 2] = state
        if recorded is not None:
            self.array[base + 3] = recorded

    def read(self, rank: int) -> tuple[float, int, float, int]:
        beat, step, state, recorded = self.array[rank * _FIELDS:(rank + 1) * _FIELDS]
        return beat, int(step), state, int(recorded)


@dataclass(frozen=True)
class RankSpec:
    """What the launcher tells each rank before it starts."""

    rank: int
    world_size: int
    run_dir: Path
    backend: str = "auto"
    pg_timeout_s: float = 120.0
    config: RunConfig | None = None  # None for a plain function
    env: tuple[tuple[str, str], ...] = ()  # extra environment for this rank only (applied last: it wins)
    launcher_pid: int = 0  # the process that started the ranks: when it is gone, the rank takes its group down


def rank_main(fn: Callable[[RankContext], Any], spec: RankSpec, beats: Heartbeats, port: Any) -> None:
    """Entry point of a launched rank (fork): set up, run fn(ctx), record any failure, and exit."""
    _detach_from_parent(spec.launcher_pid)
    torch.set_num_threads(1)  # one thread per rank; also avoids the fork-after-threads hang
    _redirect_output(RunDir(spec.run_dir).log(spec.rank))
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a segfault leaves a Python traceback in the log
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # the watchdog asks for stacks
    beats.beat(spec.rank, state=INITIALISING)
    ctx, code = None, 0
    try:
        store, ctx = _init(spec, beats, port)
        result = fn(ctx)
        if result is not None:
            torch.save(result, RunDir(spec.run_dir).result(spec.rank))
        beats.beat(spec.rank, state=FINISHING)
        _finish(store, spec)
        beats.beat(spec.rank, state=DONE)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        write_rank_error(spec.run_dir, spec.rank, ctx.step if ctx else -1, exc)
        code = 1
    finally:
        leave(ctx, destroy_group=False)  # a clean finish destroyed it already (_finish); a failure exits at once
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip the parent's atexit handlers (a forked Jupyter kernel has many)


def spawn_main(payload: bytes, spec: RankSpec, beats: Heartbeats, port: Any) -> None:
    """Entry point under spawn: the function travels pickled by value, so notebook-cell functions work."""
    import cloudpickle
    rank_main(cloudpickle.loads(payload), spec, beats, port)


def _init(spec: RankSpec, beats: Heartbeats, port: Any) -> tuple[Any, RankContext]:
    store = _rendezvous(spec, port, timedelta(seconds=spec.pg_timeout_s))
    _set_rank_env(spec, port.value)
    # one machine: the local rank is the rank, and every rank is here
    ctx = join(JoinSpec(rank=spec.rank, world_size=spec.world_size, local_rank=spec.rank, ranks_here=spec.world_size,
                        backend=spec.backend, run_dir=spec.run_dir, config=spec.config, timeout_s=spec.pg_timeout_s),
               store, heartbeats=beats)
    store.add("labkit/joined", 1)   # _finish waits for this count before any rank leaves
    beats.beat(spec.rank, state=RUNNING)
    return store, ctx


def _rendezvous(spec: RankSpec, port: Any, timeout: timedelta) -> Any:
    """Rank 0 hosts a TCPStore on a port the OS picks (no two launches can collide); the others join it."""
    import torch.distributed as dist
    if spec.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        port.value = store.port
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while port.value == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {spec.rank}: rank 0 did not open the rendezvous store in {timeout}")
        time.sleep(0.001)
    return dist.TCPStore("127.0.0.1", port.value, spec.world_size, is_master=False, timeout=timeout)


def _finish(store: Any, spec: RankSpec) -> None:
    """Count finished ranks in the store; rank 0 hosts it, so it leaves last; no rank leaves before every rank has
    joined the group. No collective: ranks that finish early (uneven inputs) must not enter a barrier that a busy
    rank would mistake for its own op."""
    import torch.distributed as dist
    # A rank whose function makes no collective can finish while a slower peer is still inside
    # init_process_group: leaving then closes the sockets that peer's gloo is connecting to ("Gloo
    # connectFullMesh failed ... Connection closed by peer", seen with a core kept busy). So no rank
    # leaves before every rank has joined.
    while store.add("labkit/joined", 0) < spec.world_size:
        time.sleep(0.002)
    store.add("labkit/finished", 1)
    if spec.rank == 0:
        while store.add("labkit/finished", 0) < spec.world_size:
            time.sleep(0.002)
    if dist.is_initialized():
        dist.destroy_process_group()  # before the store's host leaves (leave() then has nothing to destroy)


def _set_rank_env(spec: RankSpec, port: int) -> None:
    # The variables torchrun would set, so user code that reads them behaves the same under both launchers.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(spec.rank),
                      WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(spec.rank),
                      LOCAL_WORLD_SIZE=str(spec.world_size), OMP_NUM_THREADS="1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(dict(spec.env))


def _detach_from_parent(launcher_pid: int) -> None:
    """Lead a process group of our own (the launcher stops a rank and everything it started with one killpg), and
    take that whole group down if the launcher dies without stopping us (a notebook kernel killed by SIGKILL).

    A death signal from the kernel (PR_SET_PDEATHSIG) would kill the rank alone and orphan what it started (a
    subprocess, a tool), so a thread watches the parent instead and kills the group, the rank included."""
    os.setsid()
    launcher_pid = launcher_pid or os.getppid()
    threading.Thread(target=_die_with_launcher, args=(launcher_pid,), name="labkit-launcher-watch",
                     daemon=True).start()


def _die_with_launcher(launcher_pid: int) -> None:
    while os.getppid() == launcher_pid:  # reparented (to init or a subreaper) once the launcher is gone
        time.sleep(LAUNCHER_POLL_S)
    os.killpg(0, signal.SIGKILL)


def _redirect_output(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
