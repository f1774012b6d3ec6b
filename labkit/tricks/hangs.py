"""Hangs on purpose: four ways ranks stop waiting for each other forever, each one bounded by labkit's watchdog.

    from labkit.tricks import hangs
    out = hangs.reproduce("order", timeout=3)           # three ranks; out.failure is the RankFailure
    out.failure.rank, out.failure.detail                # 1, "waiting inside torch (... in broadcast), called at ..."
    hangs.bug_line("order")                             # "hangs.py:<n>": the line the report should name
    hangs.reproduce("order", fixed=True).finished       # True: the fix, and the run ends
    hangs.reproduce("lock", debug=hangs.Debug(barrier_s=1.0))   # rank 0's monitored_barrier names rank 1
    labkit.launch(functools.partial(hangs.ddp_under_debug, level="INFO", unused=True), world_size=2)
    timed = hangs.timed(("lock", "order"), cores=2, debug=hangs.Debug(barrier_s=1.0))  # on pinned, metered cores
    timed.outcomes["lock"].noticed, timed.others    # when labkit saw it fail; what other programs took meanwhile

The kinds (KINDS): "rank0_only" a collective only rank 0 calls; "order" collectives in a different order on one
rank; "shape" an all-reduce whose tensor is shorter on one rank; "loop" / "lock" a rank stuck in its own Python
(spinning on a file, or re-taking a lock it holds) while the others wait in a collective. Each scenario is a
small training-like loop of STEPS steps on a raw process group, wrong on rank 0 or 1 at step AT; `fixed=True`
runs the corrected code. The line that goes wrong carries the comment `# <- the bug`.

Debug switches each scenario can turn on, one by one (Debug): TORCH_DISTRIBUTED_DEBUG's level on a fresh group
(DETAIL wraps it in torch's collective checker), a monitored_barrier just before each step's collectives, and
the flight recorder (TORCH_FR_BUFFER_SIZE), dumped by each rank once its own progress stalls (debugtools reads
the dumps).
"""
from __future__ import annotations

import inspect
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..measure.bounds import below
from ..measure.cores import CpuMeter, pinned_to, wait_for_quiet
from ..records import Run
from ..run import RankFailure, launch
from ..rundir import RunDir

STEPS, AT = 6, 2          # steps per scenario, and the step at which it goes wrong
GRADS = 1000              # elements in the stand-in for a gradient bucket
CLASSES = 1000            # classes of the stand-in classifier whose label counts are all-reduced
FR_ENTRIES = 256          # flight-recorder ring size (TORCH_FR_BUFFER_SIZE) when Debug(flight_recorder=True)
MARK = "# <- the bug"


@dataclass(frozen=True)
class Debug:
    """Debugging aids a scenario turns on inside each rank:  Debug(level="DETAIL"), Debug(barrier_s=1.0)."""

    level: str = "OFF"
    """TORCH_DISTRIBUTED_DEBUG level for the group the scenario uses: "OFF", "INFO" or "DETAIL" (a fresh group is
    made after setting it: the variable is read when torch.distributed is imported, so in a forked rank it is set
    with dist.set_debug_level instead)."""
    barrier_s: float | None = None
    """Call dist.monitored_barrier(timeout=barrier_s) just before each step's collectives: rank 0 then names the
    ranks that did not arrive."""
    flight_recorder: bool = False
    """Record every collective (torch's flight recorder) and dump it to rank<r>.fr.json when the rank stalls."""
    stall_s: float = 1.0
    """How long a rank's own progress must stall before it dumps its flight recorder."""


@dataclass
class Outcome:
    """What one reproduce() call gave: the failure (None when the run finished), the run, and its wall time."""

    kind: str
    seconds: float
    failure: RankFailure | None
    run: Run = field(repr=False)
    noticed: float | None = None
    """Seconds from the launch to the moment labkit's watchdog saw the failure (a rank exiting with an error, or the
    timeout passing); `seconds` adds what the report then takes (waiting for the peers, reading their stacks)."""

    @property
    def finished(self) -> bool:
        return self.failure is None


def reproduce(kind: str, *, fixed: bool = False, debug: Debug = Debug(), world_size: int = 3, timeout: float = 3.0,
              **launch_kwargs: Any) -> Outcome:
    """Launch scenario `kind` (fixed or not) on `world_size` ranks; return how it ended instead of raising."""
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r}: must be one of {', '.join(KINDS)}")
    env = {r: {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES)} for r in range(world_size)} if debug.flight_recorder else {}
    worker = _Scenario(KINDS[kind], fixed, debug)
    launch_kwargs.setdefault("echo", False)
    launch_kwargs.setdefault("progress", False)
    started, wall = time.monotonic(), time.time()
    try:
        run = launch(worker, world_size=world_size, timeout=timeout, name=f"{kind}{'-fixed' * fixed}", env=env,
                     **launch_kwargs)
        return Outcome(kind, time.monotonic() - started, None, run)
    except RankFailure as failure:
        noticed = failure.noticed_at - wall if failure.noticed_at is not None else None
        return Outcome(kind, time.monotonic() - started, failure, failure.run, noticed)


@dataclass
class Timed:
    """reproduce() of several kinds, each on pinned cores with a meter on them (what measure.gated judges a timing
    claim by): the Outcome per kind, and the most cores other programs kept busy during any of them."""

    outcomes: dict[str, Outcome]
    others: float
    settings: dict[str, Any] = field(repr=False)

    def again(self) -> "Timed":
        """The same reproductions, measured afresh (a claims gate calls it after a busy measurement)."""
        return timed(**self.settings)

    def wait_for_quiet(self, limit: float, timeout_s: float = 10.0) -> float:
        return wait_for_quiet(self.settings["cores"], limit, timeout_s)


def timed(kinds: tuple[str, ...], *, cores: int, **reproduce_kwargs: Any) -> Timed:
    """reproduce(kind, **reproduce_kwargs) for each kind, pinned to `cores` cores and metered:
    timed(("lock", "order"), cores=2, timeout=2.0, debug=Debug(barrier_s=1.0))."""
    outcomes, others = {}, []
    for kind in kinds:
        with pinned_to(cores), CpuMeter() as meter:
            start = time.time()
            outcomes[kind] = reproduce(kind, **reproduce_kwargs)
            end = time.time()
        others.append(meter.cores_busy(start, end)[1])
    return Timed(outcomes, max(others), dict(kinds=tuple(kinds), cores=cores, **reproduce_kwargs))


def barrier_speaks_first(timed: Timed) -> None:
    """The claim of lesson 12: with a monitored_barrier before each step's collectives, labkit sees the loop and
    lock hangs fail (rank 0's barrier raises) sooner than its watchdog sees the order hang (nobody is missing from
    a barrier there, so only the timeout ends it). Compares when each failure was noticed, not when its report
    was done (the report then waits for the peers and reads their stacks, the same for both):
    gated("12: ...", barrier_speaks_first, timed(("loop", "lock", "order"), cores=2, debug=Debug(barrier_s=1.0)))."""
    noticed = {kind: out.noticed for kind, out in timed.outcomes.items()}
    assert None not in noticed.values(), f"a run did not fail: {noticed}"
    barrier = max(noticed["loop"], noticed["lock"])
    assert below(barrier / noticed["order"], 1.0, "slower of loop, lock / order: noticed after (s / s)"), noticed


def bug_line(kind: str) -> str:
    """"hangs.py:<line>" of the line marked `# <- the bug` in scenario `kind`: where a report should point."""
    lines, first = inspect.getsourcelines(_write_line if kind == "lock" else KINDS[kind])
    marked = [first + i for i, text in enumerate(lines) if MARK in text]
    return f"{Path(__file__).name}:{marked[0]}"


def source(kind: str) -> str:
    """The scenario's code, to read next to its report."""
    return inspect.getsource(KINDS[kind])


# --- the scenarios: fn(ctx, group, fixed, meet), a loop of STEPS steps. ctx.heartbeat(step) starts a step and
# ctx.record(step) ends it; meet() stands just before the step's collectives: Debug(barrier_s) puts a
# monitored_barrier there, and otherwise it does nothing ---------------------------------------------------------

def rank0_only(ctx: Any, group: Any, fixed: bool, meet: Callable[[], None]) -> None:
    """At an evaluation step, rank 0 averages the validation loss for its log line; then all meet at a barrier."""
    grads, val_loss = torch.ones(GRADS), torch.tensor([float(ctx.rank)])
    for step in range(STEPS):
        ctx.heartbeat(step)
        meet()
        dist.all_reduce(grads, group=group)
        if step == AT:
            if ctx.rank == 0 or fixed:  # fixed: every rank joins; only rank 0 prints the mean
                dist.all_reduce(val_loss, group=group)  # <- the bug: inside `if rank == 0`, nobody else calls it
            dist.barrier(group=group)   # everyone, before rank 0 writes a checkpoint
        ctx.record(step)


def order(ctx: Any, group: Any, fixed: bool, meet: Callable[[], None]) -> None:
    """Each step all-reduces gradients and broadcasts rank 0's running statistics; rank 1 decides, from its own
    batch, to refresh the statistics first."""
    grads, stats = torch.ones(GRADS), torch.zeros(10)
    for step in range(STEPS):
        ctx.heartbeat(step)
        odd_batch = ctx.rank == 1 and step == AT   # a decision each rank makes on its own data
        meet()
        if odd_batch and not fixed:
            dist.broadcast(stats, src=0, group=group)  # <- the bug: this rank's order differs from its peers'
            dist.all_reduce(grads, group=group)
        else:
            dist.all_reduce(grads, group=group)
            dist.broadcast(stats, src=0, group=group)
        ctx.record(step)


def shape(ctx: Any, group: Any, fixed: bool, meet: Callable[[], None]) -> None:
    """Each step all-reduces how often each class occurred; rank 1's batch at step AT lacks the top classes, and
    torch.bincount without minlength makes its tensor shorter."""
    for step in range(STEPS):
        ctx.heartbeat(step)
        top = CLASSES - 100 if ctx.rank == 1 and step == AT else CLASSES
        labels = torch.arange(top)  # this batch's labels
        counts = torch.bincount(labels, minlength=CLASSES if fixed else 0)
        meet()
        dist.all_reduce(counts, group=group)  # <- the bug: counts has top, not CLASSES, entries on rank 1
        ctx.record(step)


def loop(ctx: Any, group: Any, fixed: bool, meet: Callable[[], None]) -> None:
    """Rank 0 writes a marker file after the step's all-reduce; rank 1 spins until it sees it, before its own."""
    grads, marker = torch.ones(GRADS), ctx.run_dir / "rank0-saved"
    for step in range(STEPS):
        ctx.heartbeat(step)
        if ctx.rank == 0 and step == AT and fixed:
            marker.touch()  # fixed: write first, then meet in the collective
        if ctx.rank == 1 and step == AT:
            while not marker.exists():  # <- the bug: rank 0 writes it only after the all-reduce rank 1 never joins
                pass
        meet()
        dist.all_reduce(grads, group=group)
        if ctx.rank == 0 and step == AT:
            marker.touch()
        ctx.record(step)


_log_lock = threading.Lock()


def lock(ctx: Any, group: Any, fixed: bool, meet: Callable[[], None]) -> None:
    """Rank 1 logs a warning at step AT; the logger holds a lock and calls a helper that takes it again."""
    grads = torch.ones(GRADS)
    for step in range(STEPS):
        ctx.heartbeat(step)
        if ctx.rank == 1 and step == AT:
            _log_warning(f"step {step}: loss spike", reentrant=fixed)
        meet()
        dist.all_reduce(grads, group=group)
        ctx.record(step)


def _log_warning(text: str, reentrant: bool) -> None:
    guard = threading.RLock() if reentrant else _log_lock  # fixed: a lock the holder may take again
    with guard:
        _write_line(text, guard)


def _write_line(text: str, guard: Any) -> None:
    with guard:  # <- the bug: the caller already holds this non-reentrant lock
        print(text)


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.skipped = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, skip: bool = True) -> torch.Tensor:
        return self.used(x) if skip else self.used(x) + self.skipped(x)


def ddp_under_debug(ctx: Any, *, level: str = "OFF", unused: bool = False) -> None:
    """Launch target: three DDP steps on a fresh group made at TORCH_DISTRIBUTED_DEBUG=`level`; with unused=True
    forward never uses one layer, so DDP's reducer stops at the second step, and INFO names the parameters."""
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # DETAIL crashes DDP here: no core file in the notebook folder
    dist.set_debug_level(getattr(dist.DebugLevel, level))
    group = dist.new_group(backend="gloo")
    model = torch.nn.parallel.DistributedDataParallel(_TwoLayers(), process_group=group)
    for step in range(3):
        ctx.heartbeat(step)
        model(torch.ones(3, 4), skip=unused).sum().backward()
        ctx.record(step)


KINDS: dict[str, Callable[..., None]] = {"rank0_only": rank0_only, "order": order, "shape": shape, "loop": loop,
                                         "lock": lock}


# --- inside each rank ----------------------------------------------------------------------------------------

class _Scenario:
    """The launched function: sets up the debugging aids, then runs the scenario (picklable for spawn)."""

    def __init__(self, fn: Callable[..., None], fixed: bool, debug: Debug):
        self.fn, self.fixed, self.debug = fn, fixed, debug
        self.__name__ = self.__qualname__ = fn.__name__

    def __call__(self, ctx: Any) -> None:
        RunDir(ctx.run_dir).pidfile(ctx.rank).write_text(str(os.getpid()))  # for py-spy, from outside
        group = None
        if self.debug.level != "OFF":
            dist.set_debug_level(getattr(dist.DebugLevel, self.debug.level))
            group = dist.new_group(backend="gloo")  # DETAIL wraps new groups in torch's collective checker
        if self.debug.flight_recorder:
            threading.Thread(target=_dump_when_stalled, args=(ctx, self.debug.stall_s), daemon=True).start()

        def meet() -> None:
            if self.debug.barrier_s:
                dist.monitored_barrier(group=group, timeout=timedelta(seconds=self.debug.barrier_s),
                                       wait_all_ranks=True)
        try:
            self.fn(ctx, group, self.fixed, meet)
        except BaseException:
            if self.debug.flight_recorder:  # a rank that fails (DETAIL's check, a lost peer) still leaves its record
                from .debugtools import dump_flight_recorder
                dump_flight_recorder(RunDir(ctx.run_dir).flight_record(ctx.rank))
            raise


def _dump_when_stalled(ctx: Any, stall_s: float) -> None:
    """Once this rank has made no progress for stall_s, write its flight recorder to rank<r>.fr.json (once)."""
    from .debugtools import dump_flight_recorder
    while ctx.heartbeats is not None:
        if time.time() - ctx.heartbeats.read(ctx.rank)[0] > stall_s:
            dump_flight_recorder(RunDir(ctx.run_dir).flight_record(ctx.rank))
            return
        time.sleep(0.05)


def reported_soon(timed: Timed) -> str:
    """Lesson 12's timing claim: each hang in `timed` was reported within its watchdog timeout plus 5 s (the report
    waits for the peers and reads their stacks). gated("12: ...", reported_soon, timed(...))."""
    limit = timed.settings["timeout"] + 5
    seconds = {kind: round(out.seconds, 1) for kind, out in timed.outcomes.items()}
    assert below(max(seconds.values()), limit, "slowest hang report (s)"), f"{seconds} (limit {limit:g} s)"
    return f"slowest report {max(seconds.values()):.1f} s (limit {limit:g} s)"


def waits_in(failure: RankFailure) -> dict[int, tuple[str, int | None, list[str]]]:
    """Each rank's state, step and the collectives its report says it waits in: {rank: (state, step, [ops])}."""
    import re
    return {s.rank: (s.state, s.step, re.findall(r"in (\w+)\), called at", s.detail)) for s in failure.statuses}
