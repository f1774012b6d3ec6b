"""Time several variants of a run fairly: interleaved rounds, pinned cores, a meter on them; keep each one's
least disturbed repeat.

    timed = interleaved({"0 workers": cfg, "2 workers": cfg.replace(data_workers=2)}, rounds=3, cores=2, warmup=4)
    timed["2 workers"].run        # the Run kept for this variant
    timed["2 workers"].others     # cores other programs kept busy, on the pinned cores, during its steady steps
    timed.table()                 # one row per variant: ms per step, our cores, others' cores, repeats
    timed.only(["0 workers"]).again()   # measure a subset afresh, the same way (what a claims gate retries)
    timed.paired("2 workers", "0 workers")   # per round, one's step time over the other's, measured side by side

Why each part:
- Rounds, alternating order (A B C, then C B A, ...): load from the rest of the machine drifts, and visiting every
  variant in every round spreads the drift over all of them instead of spoiling one.
- Pinned (measure.pinned_to): every variant runs on the same cores on any machine, and the CpuMeter watches
  exactly those cores, so a busy core that our ranks never touch does not count.
- The least disturbed repeat: other programs on our cores only ever take time away. Per variant we keep the
  repeat in which they took the least (compared to 0.1 core), and among those the fastest.
- The steady steps: from the end of step `warmup - 1` to the end of the second-to-last step. Start-up, the first
  batches and the last step (which also stops DataLoader workers) are left out of both the time and the meter.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Iterable, Mapping, Union

import pandas as pd

from ..config import RunConfig
from ..records import Run
from ..run.launch import launch
from .cores import CpuMeter, pinned_to, wait_for_quiet

Variant = Union[RunConfig, Callable[[], Run]]   # a config to launch, or a function that launches and returns a Run


@dataclasses.dataclass(frozen=True)
class Timing:
    """One variant's kept repeat: its Run, wall seconds per steady step, and the cores busy meanwhile."""
    label: str
    run: Run
    step_s: float                 # wall seconds per steady step (the window over the number of its steps)
    ours: float                   # cores kept busy by this process and its descendants (launcher, ranks, workers)
    others: float                 # cores kept busy by every other program, on the pinned cores
    repeats: tuple[tuple[float, float], ...] = ()   # (others, step_s) of every repeat, in the order they ran


class Timings(dict):
    """{label: Timing}, remembering how it was measured, so that a subset can be measured again the same way."""

    def __init__(self, timings: Mapping[str, Timing], variants: Mapping[str, Variant], settings: dict[str, Any]):
        super().__init__(timings)
        self.variants, self.settings = dict(variants), settings

    @property
    def others(self) -> float:
        """The most cores other programs took during any kept repeat: how disturbed this measurement was."""
        return max((t.others for t in self.values()), default=0.0)

    @property
    def runs(self) -> dict[str, Run]:
        return {label: t.run for label, t in self.items()}

    def only(self, labels: Iterable[str | int]) -> "Timings":
        """The same measurement, restricted to `labels` (in that order; an int is a position in measuring order):
        timed.only(["0 workers", "2 workers"]), timed.only([0, 2])."""
        order = list(self)
        labels = [order[label] if isinstance(label, numbers.Integral) else label for label in labels]
        unknown = [label for label in labels if label not in self]
        if unknown:
            raise KeyError(f"no variant {unknown}; measured: {list(self)}")
        return Timings({label: self[label] for label in labels}, {label: self.variants[label] for label in labels},
                       self.settings)

    def __or__(self, other: "Timings") -> "Timings":
        """Two measurements made the same way, as one (a claim may compare variants of both):  one | two."""
        if not isinstance(other, Timings) or other.settings != self.settings:
            raise ValueError("only Timings measured with the same rounds, cores, warm-up and launch arguments can "
                             f"be joined; got {getattr(other, 'settings', type(other).__name__)} and {self.settings}")
        return Timings({**self, **other}, {**self.variants, **other.variants}, self.settings)

    def wait_for_quiet(self, limit: float, timeout_s: float = 10.0) -> float:
        """Wait (at most timeout_s) until other programs keep at most `limit` of the cores this was measured on
        busy; the others' cores last seen. A claims gate calls it before measuring again."""
        return wait_for_quiet(self.settings["cores"], limit, timeout_s)

    def again(self) -> "Timings":
        """Measure these variants afresh, with the same rounds, cores and warm-up."""
        return interleaved(self.variants, **self.settings)

    def paired(self, a: str, b: str) -> list[float]:
        """Per round, a's wall seconds per steady step over b's, from the repeats made in that round:
        timed.paired("3 workers", "2 workers") -> [0.88, 0.93, 0.86]. The variants of one round ran one after the
        other (interleaved), so a drift in the machine's speed touches both sides of each ratio alike; their median
        is steadier than the ratio of the two kept repeats, which may come from different rounds."""
        for label in (a, b):
            if label not in self:
                raise KeyError(f"no variant {label!r}; measured: {list(self)}")
        return [sa / sb for (_, sa), (_, sb) in zip(self[a].repeats, self[b].repeats)]

    def table(self) -> pd.DataFrame:
        """One row per variant: ms per steady step, cores busy (ours, others), and the repeats it was chosen from."""
        return pd.DataFrame({label: {"ms per step": 1e3 * t.step_s, "cores busy": t.ours, "others' cores": t.others,
                                     "repeats": len(t.repeats)} for label, t in self.items()}).T


def interleaved(variants: Mapping[str, Variant], *, rounds: int, cores: int, warmup: int = 1,
                **launch_kwargs: Any) -> Timings:
    """Launch every variant `rounds` times, interleaved, pinned to `cores` cores and metered; keep per variant the
    repeat least disturbed by other programs:

        timed = interleaved({"1 rank": cfg, "2 ranks": cfg.replace(world_size=2)}, rounds=3, cores=2)

    A RunConfig is launched quietly, named by its label unless it has a name (launch_kwargs go to launch); a
    function is called as it is and must return the Run it launched. `warmup`: steps left out at the start
    (at least 1), see the module docstring; every run needs warmup + 2 steps or more."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds = {rounds!r}: must be an integer >= 1")
    if not variants:
        raise ValueError("no variants to time: pass {label: RunConfig or function returning a Run}")
    labels = list(variants)
    repeats: dict[str, list[tuple[float, float, Timing]]] = {label: [] for label in labels}
    for rnd in range(rounds):
        for label in labels if rnd % 2 == 0 else labels[::-1]:
            with pinned_to(cores), CpuMeter() as meter:
                run = _launch(label, variants[label], launch_kwargs)
            ours, others = metered(run, meter, warmup)
            timing = Timing(label, run, steady_step_s(run, warmup), ours, others)
            repeats[label].append((others, timing.step_s, timing))
    kept = {}
    for label in labels:
        best = least_disturbed(repeats[label])
        kept[label] = dataclasses.replace(best, repeats=tuple((o, s) for o, s, _ in repeats[label]))
    return Timings(kept, variants, dict(rounds=rounds, cores=cores, warmup=warmup, **launch_kwargs))


def least_disturbed(repeats: list[tuple[float, float, Any]]) -> Any:
    """The item of the repeat with the fewest others' cores (to 0.1 core), then the shortest step time:
    least_disturbed([(0.52, 0.030, "a"), (0.04, 0.034, "b"), (0.01, 0.031, "c")]) -> "c"."""
    if not repeats:
        raise ValueError("no repeats to choose from")
    return min(repeats, key=lambda r: (round(r[0], 1), r[1]))[2]


def steady_window(run: Run, warmup: int = 1) -> tuple[float, float, int]:
    """(start, end, steps): time.time() at the end of step `warmup - 1` and of the second-to-last step, and the
    number of steps between:  steady_window(run, warmup=4) -> (1712.0, 1713.2, 15) for a 20-step run."""
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup = {warmup!r}: must be an integer >= 1 (step 0's start is not recorded)")
    ends = run.df.groupby("step")["time"].max()       # a step ends when its slowest rank records it
    if len(ends) < warmup + 2:
        raise ValueError(f"run {run.name!r} recorded {len(ends)} steps; warmup = {warmup} needs at least "
                         f"{warmup + 2} (warm-up, one steady step, the last): run more steps or lower warmup")
    return float(ends.iloc[warmup - 1]), float(ends.iloc[-2]), len(ends) - 1 - warmup


def steady_step_s(run: Run, warmup: int = 1) -> float:
    """Wall seconds per steady step of `run` (see steady_window):  steady_step_s(run, warmup=4) -> 0.035."""
    start, end, steps = steady_window(run, warmup)
    return (end - start) / steps


def metered(run: Run, meter: CpuMeter, warmup: int = 1) -> tuple[float, float]:
    """(ours, others): cores kept busy during `run`'s steady steps, as `meter` (running meanwhile) saw them."""
    start, end, _ = steady_window(run, warmup)
    return meter.cores_busy(start, end)


def _launch(label: str, variant: Variant, launch_kwargs: dict[str, Any]) -> Run:
    if isinstance(variant, RunConfig):
        return launch(variant if variant.name else variant.replace(name=label), echo=False, progress=False,
                      **launch_kwargs)
    if callable(variant):
        run = variant()
        if not isinstance(run, Run):
            raise TypeError(f"variant {label!r} returned {type(run).__name__}; a variant function must return the "
                            "Run that labkit.launch gave it")
        return run
    raise TypeError(f"variant {label!r} is a {type(variant).__name__}; pass a RunConfig or a function returning a Run")
