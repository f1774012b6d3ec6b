"""Start ranks from a notebook (or any Python process), watch them, stop them, and say what went wrong.

    import labkit
    run = labkit.launch(labkit.RunConfig(world_size=2, steps=20))      # labkit's instrumented DDP loop
    run = labkit.launch(my_worker, world_size=2, timeout=10)           # your function, fn(ctx), from a cell
    run = labkit.launch(cfg, max_restarts=3)                           # restart from the newest checkpoint
    run = labkit.launch(cfg, resume_from=old_run)                      # continue another run (restarts.py)

Returns a `Run` once every rank has finished. If a rank raises, dies from a signal, exits early, or makes no
progress (no ctx.record / ctx.heartbeat) for `timeout` seconds, every rank is stopped and `RankFailure` is raised
naming the rank, its step and its traceback (or signal, or stack at the time of the hang). No process is left.

Fork vs spawn: forking starts a rank in ~0.1 s but is unsafe once CUDA is initialised in this process; spawn is
safe but re-imports torch in each rank (seconds). start_method="auto" forks unless CUDA is initialised, and then
spawns, saying which call initialised CUDA.

To stop a run from elsewhere (a Stop button, another thread), pass `stop=event.is_set` for a threading.Event:
the watchdog asks it at every look, and once it says True every rank is stopped as on a failure; launch then
returns the Run with what was recorded so far, and meta.json's outcome says "stopped". No restart follows a stop.
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import re
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import RunConfig
from ..records import Run, write_meta, write_outcome, write_tensorboard
from ..training.loop import train
from ..training.tasks import preload
from ..view.live import LiveView
from . import prewarm, restarts
from .cuda_guard import cuda_init_culprit
from .diagnose import classify_exits, diagnose_hang
from .failure import LaunchError, RankFailure
from .rank import DONE, FINISHING, RUNNING, Heartbeats, RankSpec, nccl_problem, rank_main, spawn_main
from .reaping import exit_code, reap, signal_groups

POLL_S = 0.01          # how often the watchdog looks at the ranks
GRACE_S = 1.0          # after SIGTERM, how long a rank gets before SIGKILL


def launch(target: Callable[..., Any] | RunConfig, *, world_size: int | None = None, config: RunConfig | None = None,
           timeout: float = 60.0, startup_timeout: float = 60.0, start_method: str = "auto", name: str | None = None,
           runs_root: str | Path | None = None, echo: bool = True, progress: bool = True,
           live: bool = False, compare_with: tuple[Run, ...] | list[Run] = (),
           env: dict[int, dict[str, str]] | None = None, resume_from: Any = None, max_restarts: int = 0,
           stop: Callable[[], bool] | None = None) -> Run:
    """Run `target` on `world_size` ranks and return the Run; raise RankFailure if any rank fails.

    target: a RunConfig (runs labkit.train), or a function fn(ctx) (labkit.train, or one from a notebook cell).
    timeout: seconds a rank may go without recording a step or calling ctx.heartbeat() before it is declared hung.
    startup_timeout: seconds a rank may take to start and join the process group (spawn re-imports torch: seconds).
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
    run_dir = _new_run_dir(Path(runs_root or os.environ.get("LABKIT_RUNS", "runs")), name or _label(fn, config))
    if config is not None:
        config.save(run_dir / "config.json")
    if source is not None:
        restarts.adopt(source, run_dir)
    _warm_imports(config, method)
    mpctx = mp.get_context(method)
    write_meta(run_dir, launched_at=called_at, name=name or _label(fn, config), world_size=world_size,
               start_method=method, function=getattr(fn, "__qualname__", repr(fn)), timeout_s=timeout,
               pid=os.getpid(), resumed_from=str(source) if source else None, max_restarts=max_restarts)
    show = dict(echo=echo, progress=progress, live=live, compare_with=tuple(compare_with))
    failure, finished, stopped, attempt = None, False, False, 0
    try:
        while True:
            ranks_env = restarts.attempt_env(env or {}, world_size, attempt if max_restarts else None)
            failure = _attempt(fn, config, world_size, run_dir, method, mpctx, timeout, startup_timeout, ranks_env,
                               attempt, show, stop or _never)
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
    return Run(run_dir)


def _attempt(fn: Callable[..., Any], config: RunConfig | None, world_size: int, run_dir: Path, method: str,
             mpctx: Any, timeout: float, startup_timeout: float, env: dict[int, dict[str, str]], attempt: int,
             show: dict[str, Any], stop: Callable[[], bool]) -> Any:
    """Start every rank, watch them until they all finish (None), one fails (its RankFailure) or `stop` says so
    (STOPPED); then stop them all."""
    beats, port = Heartbeats.create(mpctx, world_size), mpctx.RawValue("i", 0)
    procs = _start(fn, config, world_size, run_dir, method, mpctx, beats, port, timeout, env)
    restarts.note_attempt(run_dir, attempt, pids=[p.pid for p in procs], started_at=time.time())
    view = LiveView(run_dir, world_size, config.steps if config else None, **show)
    failure, finished = None, False
    try:
        failure = _watch(procs, beats, run_dir, timeout, max(timeout, startup_timeout), view, stop)
        finished = failure is None
    finally:
        _stop(procs)
        view.close(ok=finished, recorded=[beats.read(r)[3] for r in range(world_size)])  # the last steps too
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
    if start_method not in ("auto", "fork", "spawn"):
        raise LaunchError(f"start_method = {start_method!r}: must be auto, fork or spawn")
    for rank, variables in env.items():
        if not (isinstance(rank, int) and 0 <= rank < world_size and isinstance(variables, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items())):
            raise LaunchError(f"env[{rank!r}] = {variables!r}: pass {{rank: {{'NAME': 'value'}}}} with ranks in "
                              f"0..{world_size - 1} and string names and values")


def choose_start_method(requested: str) -> str:
    """fork when it is safe (CUDA not initialised here), else spawn; an explicit fork with CUDA initialised fails."""
    culprit = cuda_init_culprit()
    if culprit is None:
        return "fork" if requested == "auto" else requested
    if requested == "fork":
        raise LaunchError("cannot fork ranks: CUDA is already initialised in this process, and a forked child "
                          f"cannot use it.\n{culprit}\nUse start_method='spawn' (or 'auto'), or restart the kernel "
                          "and launch before anything touches CUDA.")
    if requested == "auto":
        print(f"labkit: CUDA is initialised in this process, so ranks are spawned (slower to start).\n{culprit}")
    return "spawn"


# --- starting ------------------------------------------------------------------------------------------------

_warmed: set[str] = set()


def _warm_imports(config: RunConfig | None, method: str) -> None:
    """Import once, here, what every forked rank would otherwise import for itself (DDP pulls in torch._dynamo);
    in a notebook, `import labkit` did it already (prewarm.py)."""
    if method != "fork":
        return
    for module in prewarm.MODULES[:2]:  # transformers only when the task needs it (preload below)
        if module not in _warmed:
            importlib.import_module(module)
            _warmed.add(module)
    if config is not None:
        preload(config)


def _start(fn: Callable[..., Any], config: RunConfig | None, world_size: int, run_dir: Path, method: str,
           mpctx: Any, beats: Heartbeats, port: Any, timeout: float, env: dict[int, dict[str, str]]) -> list[Any]:
    # The process-group timeout is a backstop, longer than the watchdog's, so the watchdog reports first.
    specs = [RankSpec(rank=r, world_size=world_size, run_dir=run_dir, backend=config.backend if config else "auto",
                      pg_timeout_s=timeout + 60, config=config,
                      env=tuple(sorted(env.get(r, {}).items())), launcher_pid=os.getpid())
             for r in range(world_size)]
    if method == "fork":
        procs = [mpctx.Process(target=rank_main, args=(fn, s, beats, port), daemon=False) for s in specs]
        for p in procs:
            p.start()
        return procs
    import cloudpickle
    payload = cloudpickle.dumps(fn)
    procs = [mpctx.Process(target=spawn_main, args=(payload, s, beats, port), daemon=False) for s in specs]
    with _main_module_hidden():
        for p in procs:
            p.start()
    return procs


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


def _new_run_dir(root: Path, label: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")[:60] or "run"
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(2)}"
    path.mkdir(parents=True)
    return path


def _label(fn: Callable[..., Any], config: RunConfig | None) -> str:
    return config.label if config is not None else getattr(fn, "__name__", "fn")


# --- watching ------------------------------------------------------------------------------------------------

STOPPED = object()  # what _watch returns when `stop` asked for the run to end


def _never() -> bool:
    return False


def _watch(procs: list[Any], beats: Heartbeats, run_dir: Path, timeout: float, startup_timeout: float,
           view: Any, stop: Callable[[], bool]) -> Any:
    """Poll until every rank has exited cleanly (None), one has failed (the RankFailure to raise), or `stop`
    says so (STOPPED)."""
    while True:
        view.update([beats.read(r)[3] for r in range(len(procs))])
        codes = [exit_code(p) for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            time.sleep(0.05)  # let ranks that fail as a consequence finish writing their error files
            return classify_exits(procs, beats, run_dir, failed)
        if all(c == 0 for c in codes):
            return None
        alive = [r for r, c in enumerate(codes) if c is None]
        stale = [r for r in alive if _is_stale(beats, r, timeout, startup_timeout)]
        if not stale and _all_stuck_finishing(beats, alive, timeout):
            stale = alive
        if stale:
            view.mute()  # the stack dumps that follow go into the failure, not the notebook's output
            return diagnose_hang(procs, beats, run_dir, timeout)
        if stop():
            return STOPPED
        time.sleep(POLL_S)


def _is_stale(beats: Heartbeats, rank: int, timeout: float, startup_timeout: float) -> bool:
    beat, _, state, _ = beats.read(rank)
    if state in (FINISHING, DONE):
        return False  # finished its work; waiting for the others is not its fault
    return time.time() - beat > (timeout if state >= RUNNING else startup_timeout)


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
