"""Start ranks from a notebook (or any Python process), watch them, stop them, and say what went wrong.

    import labkit
    run = labkit.launch(labkit.RunConfig(world_size=2, steps=20))      # labkit's instrumented DDP loop
    run = labkit.launch(my_worker, world_size=2, timeout=10)           # your function, fn(ctx), from a cell
    run = labkit.launch(cfg, max_restarts=3)                           # restart from the newest checkpoint
    run = labkit.launch(cfg, resume_from=old_run)                      # continue another run (restarts.py)

Returns a `Run` once every rank has finished. If a rank raises, dies from a signal, exits early, or makes no
progress (no ctx.record / ctx.heartbeat) for `timeout` seconds, every rank is stopped and `RankFailure` is raised
naming the rank, its step and its traceback (or signal, or stack at the time of the hang). No process is left.

Where ranks come from: forking this process starts a rank in ~0.1 s, but is unsafe once CUDA is initialised here,
and a fresh process's first DDP step first imports torch._dynamo (seconds); spawn is safe but re-imports torch in
each rank (seconds, at every launch). labkit's warm process (run/warm.py), forked from this one when labkit was
imported in a notebook, has imported what ranks need and never touches CUDA. start_method="auto" forks ranks from
it when CUDA is initialised here (saying which call did it), and when this process has not imported what ranks
need yet and nothing they run was patched here since (run/patches.py); otherwise it forks them from this process.
"fork", "spawn" and "warm" ask for one way.

To stop a run from elsewhere (a Stop button, another thread), pass `stop=event.is_set` for a threading.Event:
the watchdog asks it at every look, and once it says True every rank is stopped as on a failure; launch then
returns the Run with what was recorded so far, and meta.json's outcome says "stopped". No restart follows a stop.
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..config import RunConfig
from ..records import Run, write_meta, write_outcome, write_tensorboard
from ..rundir import RunDir, runs_root as resolve_runs_root
from ..training.loop import train
from ..training.tasks import preload
from . import prewarm, restarts, warm
from .cuda_guard import cuda_init_culprit, fork_poisoned_by
from .diagnose import await_exits, classify_exits, diagnose_hang
from .failure import LaunchError
from .rank import DONE, FINISHING, RUNNING, Heartbeats, RankSpec, rank_main, spawn_main
from .session import nccl_problem
from .reaping import exit_code, reap, signal_groups

POLL_S = 0.01          # how often the watchdog looks at the ranks
GRACE_S = 1.0          # after SIGTERM, how long a rank gets before SIGKILL
LAUNCH_TIMEOUT_S = 60.0  # default: seconds without a recorded step or heartbeat before a rank counts as hung
STARTUP_TIMEOUT_S = 60.0  # default: seconds a rank may take to start and join the process group
PG_TIMEOUT_MARGIN_S = 60.0  # the process group's own timeout is the watchdog's plus this: the watchdog reports first


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one launch decided before any rank started; every attempt (restart) runs the same plan."""

    fn: Callable[..., Any]
    config: RunConfig | None
    world_size: int
    run_dir: Path
    method: str
    """"fork", "spawn" or "warm" (choose_start_method, then _prepare_warm)."""
    timeout: float
    """Seconds a running rank may go without progress."""
    startup_timeout: float
    """Seconds a rank may take before it is running; never shorter than `timeout`."""
    env: dict[int, dict[str, str]]
    show: dict[str, Any]
    """What the notebook sees: echo, progress, live, compare_with (LiveView's options)."""
    stop: Callable[[], bool]
    warm: Any = None
    """The warm process's pickled launch (warm.Prepared) when method is "warm"."""

    @property
    def pg_timeout_s(self) -> float:
        return self.timeout + PG_TIMEOUT_MARGIN_S


def launch(target: Callable[..., Any] | RunConfig, *, world_size: int | None = None, config: RunConfig | None = None,
           timeout: float = LAUNCH_TIMEOUT_S, startup_timeout: float = STARTUP_TIMEOUT_S, start_method: str = "auto",
           name: str | None = None, runs_root: str | Path | None = None, run_dir: str | Path | None = None,
           echo: bool = True, progress: bool = True, live: bool = False, compare_with: tuple[Run, ...] | list[Run] = (),
           env: dict[int, dict[str, str]] | None = None, resume_from: Any = None, max_restarts: int = 0,
           stop: Callable[[], bool] | None = None) -> Run:
    """Run `target` on `world_size` ranks and return the Run; raise RankFailure if any rank fails.

    target: a RunConfig (runs labkit.train), or a function fn(ctx) (labkit.train, or one from a notebook cell).
    timeout: seconds a rank may go without recording a step or calling ctx.heartbeat() before it is declared hung.
    startup_timeout: seconds a rank may take to start and join the process group (spawn re-imports torch: seconds).
    runs_root: where the run's new directory is made ($LABKIT_RUNS, else ./runs). run_dir: the run directory itself
        instead (created; refused if it already holds another run's records).
    echo: print each rank's output, prefixed with its rank. progress/live: a progress line / live figure in Jupyter.
    env: extra environment variables per rank, {rank: {"NAME": "value"}}, as if that rank had been started with them.
    resume_from: a Run or a directory with checkpoints (RunConfig.checkpoint_every): this new run starts from its
        newest complete checkpoint (or from the step_* directory given).
    max_restarts: after a failure, stop every rank and start them all again from the newest checkpoint, up to this
        many times; the records say which attempt wrote them and Run.attempts() what each cost. The last failure
        is raised when none are left.
    stop: asked at every look of the watchdog; True stops every rank, and the Run recorded so far is returned.
    """
    called_at = time.time()
    fn, config = _resolve_target(target, config)
    if world_size is None and config is not None:
        world_size = config.world_size
    _check_arguments(world_size, config, timeout, start_method, env or {})
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise LaunchError(f"max_restarts = {max_restarts!r}: pass how many times to restart after a failure, >= 0")
    source = restarts.source_checkpoint(resume_from) if resume_from is not None else None
    method = choose_start_method(start_method)
    method, prepared, note = _prepare_warm(fn, config, method, start_method, stop)
    label = name or _label(fn, config)
    if run_dir is not None and runs_root is not None:
        raise LaunchError(f"runs_root = {str(runs_root)!r} and run_dir = {str(run_dir)!r}: pass one (run_dir is the "
                          "run's directory itself, runs_root where a new one is made)")
    run_dir = RunDir.claim(run_dir) if run_dir is not None else RunDir.new(resolve_runs_root(runs_root), label)
    if config is not None:
        config.save(run_dir.config)
    if source is not None:
        restarts.adopt(source, run_dir)
    _warm_imports(config, method)
    write_meta(run_dir, launched_at=called_at, name=label, world_size=world_size, start_method=method,
               function=getattr(fn, "__qualname__", repr(fn)), timeout_s=timeout, pid=os.getpid(),
               resumed_from=str(source) if source else None, max_restarts=max_restarts, start_note=note)
    plan = LaunchPlan(fn=fn, config=config, world_size=world_size, run_dir=run_dir.path, method=method,
                      timeout=timeout, startup_timeout=max(timeout, startup_timeout), env=env or {},
                      show=dict(echo=echo, progress=progress, live=live, compare_with=tuple(compare_with)),
                      stop=stop or _never, warm=prepared)
    failure, finished, stopped, attempt = None, False, False, 0
    try:
        while True:
            failure = _attempt(plan, attempt, restarts.attempt_env(plan.env, world_size,
                                                                   attempt if max_restarts else None))
            stopped = failure is STOPPED
            failure = None if stopped else failure
            restarts.note_attempt(run_dir, attempt, ended_at=time.time(),
                                  failure=str(failure).splitlines()[0] if failure is not None else None)
            if failure is None or attempt >= max_restarts:
                break
            restarts.set_aside(run_dir, attempt, failure)
            if echo:
                print(restarts.restart_line(failure, attempt, max_restarts))
            attempt += 1
        finished = failure is None and not stopped
    finally:
        write_outcome(run_dir, None if finished or stopped else str(failure or "interrupted"), stopped=stopped)
        if config is not None and config.tensorboard:
            write_tensorboard(run_dir)  # after the ranks, so it costs them nothing; failed runs get events too
    if failure is not None:
        raise failure
    return Run(run_dir.path)


def _attempt(plan: LaunchPlan, attempt: int, env: dict[int, dict[str, str]]) -> Any:
    """Start every rank, watch them until they all finish (None), one fails (its RankFailure) or `plan.stop` says
    so (STOPPED); then stop them all."""
    from ..view.live import LiveView  # here: matplotlib, which `import labkit` leaves out, comes with the first launch
    procs, beats = _start(plan, env)
    restarts.note_attempt(RunDir(plan.run_dir), attempt, pids=[p.pid for p in procs], started_at=time.time())
    view = LiveView(plan.run_dir, plan.world_size, plan.config.steps if plan.config else None, **plan.show)
    failure, finished = None, False
    try:
        failure = _watch(procs, beats, plan, view)
        finished = failure is None
    finally:
        _stop(procs)
        view.close(ok=finished, recorded=[beats.read(r)[3] for r in range(plan.world_size)])  # the last steps too
    return failure


def _resolve_target(target: Any, config: RunConfig | None) -> tuple[Callable[..., Any], RunConfig | None]:
    if isinstance(target, RunConfig):
        return train, target
    if not callable(target):
        raise LaunchError(f"launch(target={target!r}): pass a RunConfig or a function fn(ctx)")
    return target, config


def _check_arguments(world_size: int | None, config: RunConfig | None, timeout: float, start_method: str,
                     env: dict[int, dict[str, str]]) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise LaunchError(f"world_size = {world_size!r}: pass an integer >= 1 (or a RunConfig that has one)")
    if config is not None:
        config.validate()
        if world_size != config.world_size:
            raise LaunchError(f"world_size = {world_size} but config.world_size = {config.world_size}; "
                              "pass one of them, or make them agree")
        if config.backend == "nccl" and nccl_problem(world_size):
            raise LaunchError(f"RunConfig.backend = 'nccl': {nccl_problem(world_size)}")  # before any rank starts
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LaunchError(f"timeout = {timeout!r}: pass the seconds a rank may go without progress, > 0")
    if start_method not in ("auto", "fork", "spawn", "warm"):
        raise LaunchError(f"start_method = {start_method!r}: must be auto, fork, spawn or warm")
    for rank, variables in env.items():
        if not (isinstance(rank, int) and 0 <= rank < world_size and isinstance(variables, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items())):
            raise LaunchError(f"env[{rank!r}] = {variables!r}: pass {{rank: {{'NAME': 'value'}}}} with ranks in "
                              f"0..{world_size - 1} and string names and values")


def choose_start_method(requested: str) -> str:
    """"auto": "warm" when CUDA is initialised here (else "spawn", where LABKIT_PREWARM=0), or when a warm process
    runs and this process has not imported what ranks need (launch() then checks that it may stand in: _prepare_warm);
    else "fork". An explicit fork with CUDA initialised fails. On a GPU machine with torchao installed (the fp8 extra)
    no process may fork ranks (cuda_guard.fork_poisoned_by): "auto" spawns, and fork or warm fail saying why."""
    poisoned = fork_poisoned_by()
    if poisoned is not None:   # the warm process imports torchao too: only spawned ranks can use the GPUs
        if requested in ("fork", "warm"):
            also = cuda_init_culprit()   # and CUDA initialised here, if it is: the call that did it
            raise LaunchError(f"cannot fork ranks: {poisoned}." + (f"\n{also}" if also else "")
                              + "\nUse start_method='spawn' (or 'auto').")
        if requested == "auto":
            print(f"labkit: ranks are spawned (slower to start): {poisoned}")
            return "spawn"
        return requested
    culprit = cuda_init_culprit()
    if culprit is None:
        if requested != "auto":
            return requested
        return "warm" if warm.current() is not None and not prewarm.is_warm() else "fork"
    if requested == "fork":
        raise LaunchError("cannot fork ranks: CUDA is already initialised in this process, and a forked child "
                          f"cannot use it.\n{culprit}\nUse start_method='warm' (or 'auto', or 'spawn'), or restart the "
                          "kernel and launch before anything touches CUDA.")
    if requested == "auto":
        if prewarm.wanted() is False:
            print(f"labkit: CUDA is initialised in this process, so ranks are spawned (slower to start).\n{culprit}")
            return "spawn"
        print("labkit: CUDA is initialised in this process, so ranks are forked from labkit's warm process, which "
              f"never touches CUDA.\n{culprit}")
        return "warm"
    return requested


def _prepare_warm(fn: Callable[..., Any], config: RunConfig | None, method: str, requested: str,
                  stop: Callable[[], bool] | None) -> tuple[str, Any, str | None]:
    """(method, the warm launch or None, why the warm process was not used). "auto" without CUDA falls back to a
    fork from here when the warm process may not stand in; with CUDA, to spawn when it is unavailable."""
    if method != "warm":
        return method, None, None
    cuda = cuda_init_culprit() is not None
    prepared = warm.prepare(fn, config, check=requested == "auto" and not cuda, stop=stop)
    if not isinstance(prepared, str):
        return "warm", prepared, None
    if not cuda and requested == "auto":
        return "fork", None, prepared
    if prepared.startswith("the function does not pickle"):
        raise LaunchError(f"cannot start the ranks from labkit's warm process: {prepared}. Define the function so "
                          "that it pickles (no open files, locks or generators in what it refers to)")
    print(f"labkit: {prepared}; ranks are spawned instead")
    return "spawn", None, prepared


# --- starting ------------------------------------------------------------------------------------------------

_warmed: set[str] = set()


def _warm_imports(config: RunConfig | None, method: str) -> None:
    """Import once, here, what every rank forked from here would otherwise import for itself (DDP pulls in
    torch._dynamo). Ranks forked from the warm process find it done there (prewarm.py)."""
    if method != "fork":
        return
    for module in prewarm.RANK_MODULES:  # transformers only when the task needs it (preload below)
        if module not in _warmed:
            importlib.import_module(module)
            _warmed.add(module)
    if config is not None:
        preload(config)


def _start(plan: LaunchPlan, env: dict[int, dict[str, str]]) -> tuple[list[Any], Heartbeats]:
    specs = [RankSpec(rank=r, world_size=plan.world_size, run_dir=plan.run_dir,
                      backend=plan.config.backend if plan.config else "auto", pg_timeout_s=plan.pg_timeout_s,
                      config=plan.config, env=tuple(sorted(env.get(r, {}).items())), launcher_pid=os.getpid())
             for r in range(plan.world_size)]
    method = plan.method
    if method == "warm":
        try:
            procs, beats, _ = plan.warm.start(specs, plan.stop)
            return procs, beats
        except warm.WarmUnavailable as exc:
            method = "spawn" if cuda_init_culprit() else "fork"
            print(f"labkit: {exc}; ranks are {method}ed from this process instead")
            _warm_imports(plan.config, method)
    mpctx = mp.get_context(method)
    beats, port = Heartbeats.create(mpctx, plan.world_size), mpctx.RawValue("i", 0)
    if method == "fork":
        procs = [mpctx.Process(target=rank_main, args=(plan.fn, s, beats, port), daemon=False) for s in specs]
        for p in procs:
            p.start()
        return procs, beats
    import cloudpickle
    payload = cloudpickle.dumps(plan.fn)
    procs = [mpctx.Process(target=spawn_main, args=(payload, s, beats, port), daemon=False) for s in specs]
    with _main_module_hidden():
        for p in procs:
            p.start()
    return procs, beats


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawned children re-run the parent's __main__ script unless told it has none. Ours need nothing from it
    (the function travels by value), and re-running a script without an `if __name__ == "__main__"` guard would
    launch again from inside each rank."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            main.__dict__.pop("__spec__", None)


def _label(fn: Callable[..., Any], config: RunConfig | None) -> str:
    return config.label if config is not None else getattr(fn, "__name__", "fn")


# --- watching ------------------------------------------------------------------------------------------------

STOPPED = object()  # what _watch returns when `stop` asked for the run to end


def _never() -> bool:
    return False


def _watch(procs: list[Any], beats: Heartbeats, plan: LaunchPlan, view: Any) -> Any:
    """Poll until every rank has exited cleanly (None), one has failed (the RankFailure to raise), or `plan.stop`
    says so (STOPPED)."""
    while True:
        view.update([beats.read(r)[3] for r in range(len(procs))])
        codes = [exit_code(p) for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # Peers of a dead rank fail a moment later, and say why: wait for them (diagnose.py) before reading.
            noticed = time.time()
            exited_at = await_exits(procs, dict.fromkeys(failed, noticed))
            return classify_exits(procs, beats, plan.run_dir, failed, exited_at).noticed(noticed)
        if all(c == 0 for c in codes):
            return None
        alive = [r for r, c in enumerate(codes) if c is None]
        stale = [r for r in alive if _is_stale(beats, r, plan.timeout, plan.startup_timeout,
                                               loop=plan.config is not None and plan.fn is train)]
        if not stale and _all_stuck_finishing(beats, alive, plan.timeout):
            stale = alive
        if stale:
            noticed = time.time()
            view.mute()  # the stack dumps that follow go into the failure, not the notebook's output
            return diagnose_hang(procs, beats, plan.run_dir, plan.timeout).noticed(noticed)
        if plan.stop():
            return STOPPED
        time.sleep(POLL_S)


def _is_stale(beats: Heartbeats, rank: int, timeout: float, startup_timeout: float, loop: bool = False) -> bool:
    """Whether a rank has gone too long without a beat. Starting (importing, joining the group) it has
    startup_timeout; so has labkit's training loop (`loop`) until its first step, since building the task (imports,
    data) happens inside the launched function: a rank forked from the warm process reaches RUNNING before that."""
    beat, step, state, _ = beats.read(rank)
    if state in (FINISHING, DONE):
        return False  # finished its work; waiting for the others is not its fault
    setting_up = state < RUNNING or (loop and step < 0)
    return time.time() - beat > (startup_timeout if setting_up else timeout)


def _all_stuck_finishing(beats: Heartbeats, alive: list[int], timeout: float) -> bool:
    """Every live rank has finished its work, yet none has left for `timeout` seconds (stuck in teardown)."""
    rows = [beats.read(r) for r in alive]
    return bool(rows) and all(state == FINISHING for _, _, state, _ in rows) \
        and time.time() - max(beat for beat, _, _, _ in rows) > timeout


def _stop(procs: list[Any]) -> None:
    """Stop every rank and anything it started (each rank leads its own process group), then reap them all.
    Ranks are reaped only here, after the last signal: until then their pids, and group ids, cannot be reused."""
    signal_groups(procs, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(exit_code(p) is None for p in procs):
        time.sleep(POLL_S)
    signal_groups(procs, signal.SIGKILL)  # also grandchildren of ranks that exited
    reap(procs)
