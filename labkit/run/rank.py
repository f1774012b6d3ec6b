"""Inside one rank: the context a launched function receives, and the set-up and tear-down around it.

A launched function takes one argument, the RankContext:

    def worker(ctx):                       # may be defined in a notebook cell
        model = DDP(torch.nn.Linear(4, 1))
        for step in range(10):
            ...
            ctx.record(step, loss=loss.item())   # one JSON line in runs/<id>/rank<r>.jsonl, and a heartbeat
        return model.weight.sum().item()         # comes back as run.result(rank)

    labkit.launch(worker, world_size=2)

The launcher's watchdog counts a rank as making progress while it calls `ctx.record` or `ctx.heartbeat`;
a long stretch without either (longer than launch's `timeout`) is reported as a hang.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from ..records import FAILURE_MARKER, RankRecorder

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
    config: Any = None  # a RunConfig, or None for a plain function
    env: tuple[tuple[str, str], ...] = ()  # extra environment for this rank only (applied last: it wins)
    launcher_pid: int = 0  # the process that started the ranks: when it is gone, the rank takes its group down


@dataclass
class RankContext:
    """What a launched function gets: who it is, where to write, and how to report progress."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    run_dir: Path
    config: Any
    recorder: Any
    heartbeats: Heartbeats | None = None
    step: int = -1
    """The step this rank is working on (set by heartbeat/record); failures are reported against it."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def heartbeat(self, step: int | None = None) -> None:
        """Tell the watchdog this rank is alive (and, optionally, which step it has started)."""
        if step is not None:
            self.step = step
        if self.heartbeats is not None:
            self.heartbeats.beat(self.rank, step=step)

    def record(self, step: int, **fields: Any) -> None:
        """Write one record for `step` (rank and wall time are added) and beat the heartbeat."""
        self.step = step
        self.recorder.write({"step": step, "time": time.time(), **fields})
        if self.heartbeats is not None:
            self.heartbeats.beat(self.rank, step=step, recorded=step)


def nccl_problem(ranks_here: int) -> str | None:
    """Why `ranks_here` ranks on this machine cannot use NCCL (one CUDA device each), or None when they can.
    Asks the driver for the device count only: no CUDA context is created, so forking stays safe."""
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices >= ranks_here:
        return None
    return (f"backend='nccl' needs {ranks_here} CUDA GPUs here, one per rank on this machine; {devices} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Use backend='gloo' or "
            "'auto' (gloo runs on the CPU), or fewer ranks per machine.")


def resolve_backend(requested: str, world_size: int) -> str:
    """"auto" -> nccl when every rank can have its own CUDA device, else gloo; explicit names pass through, but
    nccl only when each of the `world_size` ranks on this machine has a CUDA device of its own (NCCL refuses two
    ranks on one GPU)."""
    import torch.distributed as dist
    problem = nccl_problem(world_size) if requested == "nccl" else None
    if problem:
        raise ValueError(problem)
    if requested != "auto":
        return requested
    cuda_ok = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    return "nccl" if cuda_ok and dist.is_nccl_available() else "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU (cuda:<local rank>) under nccl, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def rank_main(fn: Callable[[RankContext], Any], spec: RankSpec, beats: Heartbeats, port: Any) -> None:
    """Entry point of a launched rank (fork): set up, run fn(ctx), record any failure, and exit."""
    _detach_from_parent(spec.launcher_pid)
    torch.set_num_threads(1)  # one thread per rank; also avoids the fork-after-threads hang
    _redirect_output(spec.run_dir / f"rank{spec.rank}.log")
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a segfault leaves a Python traceback in the log
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # the watchdog asks for stacks
    beats.beat(spec.rank, state=INITIALISING)
    ctx, code = None, 0
    try:
        store, ctx = _init(spec, beats, port)
        result = fn(ctx)
        if result is not None:
            torch.save(result, spec.run_dir / f"result{spec.rank}.pt")
        beats.beat(spec.rank, state=FINISHING)
        _finish(store, spec)
        beats.beat(spec.rank, state=DONE)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        _write_error(spec, ctx.step if ctx else -1, exc)
        code = 1
    finally:
        if ctx is not None:
            ctx.recorder.close()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip the parent's atexit handlers (a forked Jupyter kernel has many)


def spawn_main(payload: bytes, spec: RankSpec, beats: Heartbeats, port: Any) -> None:
    """Entry point under spawn: the function travels pickled by value, so notebook-cell functions work."""
    import cloudpickle
    rank_main(cloudpickle.loads(payload), spec, beats, port)


def _init(spec: RankSpec, beats: Heartbeats, port: Any) -> tuple[Any, RankContext]:
    import torch.distributed as dist
    backend = resolve_backend(spec.backend, spec.world_size)
    timeout = timedelta(seconds=spec.pg_timeout_s)
    store = _rendezvous(spec, port, timeout)
    _set_rank_env(spec, port.value)
    device = rank_device(backend, spec.rank)  # one machine: the local rank is the rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
    recorder = RankRecorder(spec.run_dir, spec.rank)
    ctx = RankContext(rank=spec.rank, world_size=spec.world_size, local_rank=spec.rank, backend=backend,
                      device=device, run_dir=spec.run_dir, config=spec.config, recorder=recorder, heartbeats=beats)
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
    """Count finished ranks in the store; rank 0 hosts it, so it leaves last. No collective: ranks that
    finish early (uneven inputs) must not enter a barrier that a busy rank would mistake for its own op."""
    import torch.distributed as dist
    store.add("labkit/finished", 1)
    if spec.rank == 0:
        while store.add("labkit/finished", 0) < spec.world_size:
            time.sleep(0.002)
    if dist.is_initialized():
        dist.destroy_process_group()


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


def _write_error(spec: RankSpec, step: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    sys.stderr.write(f"{FAILURE_MARKER} at step {step} ({type(exc).__name__}); the launcher reports the cause\n{text}")
    error = {"rank": spec.rank, "step": step, "type": type(exc).__name__, "message": str(exc),
             "traceback": text, "time": time.time()}
    (spec.run_dir / f"rank{spec.rank}.error.json").write_text(json.dumps(error, indent=2))
