"""Inside one rank of a job that `labkit watch` runs but did not write: records, progress and stacks, no code change.

    python -m labkit watch --timeout 30 -- torchrun --nproc-per-node 2 train.py
        # every rank imports this module from labkit's sitecustomize (training/site/) and calls start()
    from labkit.training import agent
    agent.start()              # by hand, or from a framework's callback; once per process, later calls return it
    agent.current()            # this process's Agent, or None

What it writes into the run directory ($LABKIT_WATCH_DIR), per rank, in the format a notebook run has:
    rank<r>.jsonl   one record per optimizer step: loss (the mean of the scalars backward() ran on since the last
                    step: this rank's own loss), loss_finite, grad_norm (before the step, this rank's gradients; a
                    sharded parameter's local shard), grads_finite, lr, t_step, t_data (from the end of the last
                    step to the first forward), t_fwd_bwd (first forward to the end of the last backward, DDP's
                    gradient all-reduce inside it), t_backward, backward_calls, samples (rows of the first tensor
                    passed positionally to the step's outermost module, per call; None for keyword-only calls, as
                    transformers' models take input_ids), rss_mb, collectives and arrivals
                    (each collective the rank issued since the last step in the default group: [seq, op,
                    time_created_ns] from the Flight Recorder; same-host clocks make them comparable across ranks)
    rank<r>.beat    five float64s rewritten in place: last progress (unix time), step, state, newest collective seq,
                    world size
    rank<r>.pid     this process, so the watcher can ask it for its stacks
    rank<r>.log     faulthandler's stack dumps on SIGUSR1 (the watcher's hang report reads them), and on a fatal
                    signal (gloo's abort on mismatched sizes, a segfault): where the rank died
    rank<r>.error.json   an exception that ended the script (what torchelastic's @record writes, without it)
    rank<r>.fr.json the Flight Recorder with frames, dumped by this agent's thread when the watcher asks (watch.ask)

Why these mechanisms: a global optimizer step hook (pre: the gradient norm; post: the record) and
torch.autograd.backward wrapped (Tensor.backward calls it) see every loop, Trainer and Lightning alike, without
the script's help; faulthandler dumps every thread's Python stack from a signal handler even while the main thread
is blocked in a collective; a daemon thread reads the Flight Recorder (the GIL is free while gloo waits), so the
watcher learns of new collectives between steps and gets the recorder on request. Nothing here changes what the
script computes: the hooks read tensors (detached, under no_grad) and call the original backward unchanged.
"""
from __future__ import annotations

import atexit
import faulthandler
import functools
import math
import mmap
import os
import signal
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..records import RankRecorder, rank_error
from ..rundir import RunDir
from . import flight

DIR_ENV = "LABKIT_WATCH_DIR"         # the run directory; set by `labkit watch`
OWNER_ENV = "LABKIT_WATCH_AGENT"     # the pid holding this rank's agent: a DataLoader worker or a child inherits it
JOIN_S = 5.0                         # at exit, how long to wait for the agent's thread to finish a read
POLL_S = 0.2                         # how often the agent's thread reads the Flight Recorder and the watcher's request
BEAT = struct.Struct("<5d")          # last progress (unix time), step, state, newest collective seq, world size
RUNNING, DONE = 1.0, 3.0             # the states a beat file holds
MAIN_THREAD_LINE = "labkit watch: main thread 0x{:016x}"  # written to rank<r>.log: which stack in a dump is the script's

_AGENT: "Agent | None" = None
_LOCK = threading.Lock()


def current() -> "Agent | None":
    """This process's agent, once started."""
    return _AGENT


def start(rank: int | None = None, run_dir: str | Path | None = None) -> "Agent | None":
    """Start recording this process as `rank` (default $RANK) into `run_dir` (default $LABKIT_WATCH_DIR); returns
    the agent, or None when this process is not a rank to watch (no run directory, no rank, or a child of a process
    that already holds one: a DataLoader worker, a subprocess)."""
    global _AGENT
    with _LOCK:
        if _AGENT is not None:
            return _AGENT
        run_dir = run_dir or os.environ.get(DIR_ENV)
        rank = rank if rank is not None else _env_int("RANK")
        owner = os.environ.get(OWNER_ENV)
        if not run_dir or rank is None or (owner and owner != str(os.getpid())):
            return None
        os.environ[OWNER_ENV] = str(os.getpid())
        _AGENT = Agent(Path(run_dir), rank, _env_int("WORLD_SIZE") or 1)
        return _AGENT


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else None


def _never_raises(hook: Callable[..., None]) -> Callable[..., None]:
    """A hook of the agent's that fails (a gradient type it cannot read, a full disk) says so once on stderr and
    lets the job go on: watching must never change what the script does."""
    said: list[bool] = []

    @functools.wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            hook(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of ours stays ours
            if not said:
                said.append(True)
                print(f"labkit watch: {hook.__name__} failed, records may miss fields: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
    return guarded


class Agent:
    """One watched rank's recorder (see the module docstring); made by start()."""

    def __init__(self, run_dir: Path, rank: int, world_size: int):
        self.run_dir, self.rank, self.world_size = RunDir(run_dir), rank, world_size
        self.step, self.seq, self.asked = 0, -1, 0.0  # seq: the newest collective seen (the thread's too)
        self._recorded_seq = -1  # the newest collective already in a record
        self._losses: list[torch.Tensor] = []
        self._t_backward, self._first_forward, self._last_backward_end = 0.0, None, None
        self._outer, self._samples = None, 0
        self._step_ended = time.perf_counter()
        self._pre: dict[str, Any] = {}
        self._notes: dict[str, Any] = {}
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._hooks = [register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step),
                       register_module_forward_pre_hook(self._on_forward)]
        self.recorder = RankRecorder(self.run_dir.path, rank)
        self._log = open(self.run_dir.log(rank), "a", buffering=1)
        self._log.write(MAIN_THREAD_LINE.format(threading.main_thread().ident) + "\n")
        faulthandler.register(signal.SIGUSR1, file=self._log, all_threads=True, chain=False)
        faulthandler.enable(file=self._log, all_threads=True)  # an abort or a segfault leaves its stack here too
        self._beat_file = self._open_beat()
        self.run_dir.pidfile(rank).write_text(str(os.getpid()))  # last: the watcher now expects progress
        self._original_backward = torch.autograd.backward
        torch.autograd.backward = self._backward
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._on_exception
        atexit.register(self.close)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="labkit-watch-agent", daemon=True)
        self._thread.start()
        self.beat()
        if flight.problem():  # a torch whose Flight Recorder moved: records and stacks still work, collectives not
            print(f"labkit watch: rank {rank}: no collectives recorded: {flight.problem()}", file=sys.stderr)

    def measure_gradients(self, optimizer: Any) -> None:
        """Read the gradient norm and LR for the next record now: a framework that runs backward inside
        optimizer.step(closure) (Lightning) has no gradients yet when the optimizer's pre-step hook fires."""
        self._before_step(optimizer, (), {})

    def note(self, **fields: Any) -> None:
        """Fields for this rank's next record (a framework's callback: Lightning's raw training_step loss)."""
        self._notes.update(fields)

    # --- what the script does ---------------------------------------------------------------------------------

    def _on_forward(self, module: Any, args: Any) -> None:
        if self._first_forward is None:  # the step's first forward: the outermost module (DDP, the model)
            self._first_forward, self._outer = time.perf_counter(), module
        if module is self._outer:  # each call of it is a micro-batch: its first tensor's rows are samples
            rows = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), 0)
            self._samples += rows

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
        if isinstance(first, torch.Tensor) and first.numel() == 1:
            self._losses.append(first.detach())
        t0 = time.perf_counter()
        try:
            return self._original_backward(tensors, *args, **kwargs)
        finally:
            self._last_backward_end = time.perf_counter()
            self._t_backward += self._last_backward_end - t0

    @_never_raises
    @torch.no_grad()
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        grads = [getattr(p.grad, "_local_tensor", p.grad) for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) \
            if grads else torch.zeros(())
        lr = optimizer.param_groups[0].get("lr", float("nan")) if optimizer.param_groups else float("nan")
        self._pre = {"grad_norm": float(norm), "lr": float(lr)}

    @_never_raises
    @torch.no_grad()
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.perf_counter()
        losses = [float(t) for t in self._losses]
        loss = sum(losses) / len(losses) if losses else float("nan")
        found = flight.entries()
        new = [e for e in found if not e.get("is_p2p") and flight.group_of(e) == "0"
               and e["collective_seq_id"] > self._recorded_seq]
        grad_norm = self._pre.get("grad_norm", float("nan"))
        first, end = self._first_forward, self._last_backward_end
        record = {"step": self.step, "loss": loss, "loss_finite": math.isfinite(loss) if losses else None,
                  "grad_norm": grad_norm, "grads_finite": math.isfinite(grad_norm), "lr": self._pre.get("lr"),
                  "t_step": now - self._step_ended,
                  "t_data": (first - self._step_ended) if first is not None else None,
                  "t_fwd_bwd": (end - first) if first is not None and end is not None and end > first else None,
                  "t_backward": self._t_backward, "backward_calls": len(losses), "rss_mb": _rss_mb(),
                  "samples": self._samples or None,
                  "collectives": len(new),
                  "arrivals": [[e["collective_seq_id"], e["profiling_name"], e["time_created_ns"]] for e in new],
                  "time": time.time(), **self._notes}
        self._notes = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            record["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        self.recorder.write(record)
        self._recorded_seq = max(self._recorded_seq, flight.last_seq(found))
        self.seq = max(self.seq, self._recorded_seq)
        self.step += 1
        self._losses, self._t_backward, self._first_forward, self._outer, self._samples = [], 0.0, None, None, 0
        self._step_ended = time.perf_counter()
        self.beat()

    def _on_exception(self, kind: type, exc: BaseException, tb: Any) -> None:
        try:
            import json
            self.run_dir.error(self.rank).write_text(json.dumps(rank_error(self.rank, self.step, exc), indent=2))
        finally:
            self._previous_excepthook(kind, exc, tb)

    # --- what the watcher reads -------------------------------------------------------------------------------

    def _open_beat(self) -> mmap.mmap:
        path = self.run_dir.beat(self.rank)
        with open(path, "wb") as f:
            f.write(BEAT.pack(time.time(), 0, RUNNING, -1, self.world_size))
        fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, BEAT.size)
        finally:
            os.close(fd)

    def beat(self, state: float = RUNNING) -> None:
        """Progress now: a step or a new collective (the watcher's clock for this rank starts again)."""
        self._beat_file[:] = BEAT.pack(time.time(), self.step, state, self.seq, self.world_size)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            seq = flight.last_seq(flight.entries())
            if seq > self.seq:
                self.seq = seq
                self.beat()
            self._answer()

    def _answer(self) -> None:
        """When the watcher asks (watch.ask newer than the last answer), dump the Flight Recorder with frames."""
        try:
            asked = self.run_dir.watch_request.stat().st_mtime
        except FileNotFoundError:
            return
        if asked > self.asked:
            self.asked = asked
            flight.dump(self.run_dir.flight_record(self.rank))

    def close(self) -> None:
        """The script ended (atexit): the agent's thread is stopped and joined, and the watcher stops expecting
        progress from this rank."""
        self._stop.set()
        # Join before the interpreter finalizes: a daemon thread left inside torch's C++ (reading the Flight
        # Recorder) while finalization tears down the interpreter and torch's statics is a crash waiting to happen
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_S)
        self.beat(DONE)
        self.recorder.close()


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")
