"""Any measurement made on pinned, metered cores, so that a claims gate can judge it and make it again:

    bench = metered(lambda: comm.benchmark(sizes=SIZES, world_size=2), cores=2)
    bench.value                 # what the function returned (here a table of timed collectives)
    bench.others                # cores other programs kept busy on the pinned cores while it ran
    gated("02: busbw grows with the message size", busbw_grows, bench)   # retries call bench.again()

measure.interleaved times launches of runs; this is for the rest (a benchmark, a sweep of wrappers, a subprocess
that imports torch): the function runs pinned to the first `cores` cores, with a CpuMeter on them, and the whole
call is metered, start-up included, so a disturbance at any moment of it counts against the measurement.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from .cores import CpuMeter, pinned_to, wait_for_quiet


@dataclasses.dataclass(frozen=True)
class Metered:
    """What `fn()` returned, the wall seconds it took, and the cores busy meanwhile (ours, and other programs')."""
    value: Any
    seconds: float
    ours: float
    others: float
    cores: int
    fn: Callable[[], Any] = dataclasses.field(repr=False)

    def again(self) -> "Metered":
        """The same function measured afresh, on the same cores."""
        return metered(self.fn, cores=self.cores)

    def wait_for_quiet(self, limit: float, timeout_s: float = 10.0) -> float:
        """Wait (at most timeout_s) for other programs to keep at most `limit` of the cores busy; what was seen."""
        return wait_for_quiet(self.cores, limit, timeout_s)


def metered(fn: Callable[[], Any], *, cores: int) -> Metered:
    """Call `fn()` pinned to the first `cores` cores (processes it starts inherit them), metered:
    metered(lambda: launch(cfg), cores=2).others -> 0.03."""
    if not callable(fn):
        raise TypeError(f"fn is a {type(fn).__name__}; pass a function of no arguments that makes the measurement")
    with pinned_to(cores), CpuMeter() as meter:
        start = time.time()
        value = fn()
        end = time.time()
    ours, others = meter.cores_busy(start, end)
    return Metered(value, end - start, ours, others, cores, fn)


@dataclasses.dataclass(frozen=True)
class Together:
    """Several measurements judged as one (a claim that compares them): the most disturbed one decides."""
    parts: tuple[Any, ...]

    @property
    def others(self) -> float:
        return max(float(p.others) for p in self.parts)

    def again(self) -> "Together":
        return Together(tuple(p.again() for p in self.parts))

    def wait_for_quiet(self, limit: float, timeout_s: float = 10.0) -> float:
        return self.parts[0].wait_for_quiet(limit, timeout_s)

    def __getitem__(self, index: int) -> Any:
        return self.parts[index]


def together(*measurements: Any) -> Together:
    """Measurements (each with .others and .again()) that one claim compares:  together(bench2, bench4)[1].value."""
    if not measurements or not all(hasattr(m, "others") and hasattr(m, "again") for m in measurements):
        raise ValueError("together(...) takes measurements that know their others' cores and can be made again "
                         "(measure.metered, measure.interleaved)")
    return Together(tuple(measurements))
