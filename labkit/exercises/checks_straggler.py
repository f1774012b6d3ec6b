"""The straggler found from a run's records, by a function the learner writes (lesson 11).

    def find_straggler(records):           # run.df: one row per (rank, step), t_step, t_fwd_bwd...
        ...                                # -> the rank the others waited for
    report = check_straggler(find_straggler)        # plants one at a random rank of 3 gloo ranks
    find_straggler = report.use(slowest_compute)    # yours if it passed

The checker trains a real run on 3 gloo ranks with Fault(kind="slow") at a random rank (it sleeps
delay_s at the start of every step), then hands the learner's function the run's records once per
rank the straggler could be: the same records with the ranks renamed, so that the planted one lands
on rank 0, 1 and 2 in turn, and once more with the straggler's step times set to the fastest
rank's (step times are equal up to noise: a step ends for all at the all-reduce). The answer must
be the planted rank each time; a wrong one is read as the usual mistake it matches:

    waited longest   the rank with the largest t_fwd_bwd (the all-reduce inside): a fast one, that
                     waited FOR the straggler; the straggler arrives last and waits least
    step time        the rank with the largest t_step: equal on every rank, it says the job is
                     slow, not who is
    off by one       the planted rank + 1 or - 1 (ranks count from 0)

The planted rank, not a time, is what an answer is judged against; the delay (0.2 s a step) is far
above the noise of a shared machine, and the reference (`slowest_compute`, the split of lesson 11)
must find it too, or the run is planted again.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ..config import RunConfig
from ..fault import Fault
from ..run import RankFailure, launch
from .learner import is_learners, report_failure
from .report import Report

AFTER = 2   # the first steps warm up: judged from this step on


@dataclass(frozen=True)
class Planted:
    """A real run with a straggler: its records, the rank that was slowed, its run directory."""

    records: pd.DataFrame
    rank: int
    world: int
    run_dir: Path


def slowest_compute(records: pd.DataFrame) -> int:
    """labkit's reference: the rank whose own work (step time minus its wait in the all-reduce) is
    the largest at the median step; it is the one the others waited for."""
    steps = records[records["step"] >= AFTER]
    waited = steps["t_fwd_bwd"] - steps.groupby("step")["t_fwd_bwd"].transform("min")
    compute = steps["t_step"] - waited
    return int(compute.groupby(steps["rank"]).median().idxmax())


def plant_straggler(*, world: int = 3, rank: int | None = None, delay_s: float = 0.2,
                    steps: int = 7, seed: int | None = None, runs_root: Any = None) -> Planted:
    """Train `steps` steps on `world` gloo ranks with `rank` (random if None) slowed by delay_s."""
    rank = random.Random(seed).randrange(world) if rank is None else rank
    # digits, the lightest task: the ranks start fast, and the delay stands far above their compute
    config = RunConfig(world_size=world, global_batch=8 * world, steps=steps, task="digits",
                       save_final=False, tensorboard=False,
                       name=f"a straggler planted (rank {rank} of {world})",
                       faults=(Fault(kind="slow", rank=rank, step=0, delay_s=delay_s),))
    run = launch(config, echo=False, progress=False, runs_root=runs_root)
    return Planted(run.df.copy(), rank, world, run.path)


def _renamed(records: pd.DataFrame, mapping: dict[int, int]) -> pd.DataFrame:
    out = records.copy()
    out["rank"] = out["rank"].map(mapping)
    return out.sort_values(["step", "rank"]).reset_index(drop=True)


def _cases(planted: Planted) -> list[tuple[str, pd.DataFrame, int]]:
    """(what was done to the records, the records, the straggler's rank in them)."""
    cases = []
    for target in range(planted.world):
        swap = {r: r for r in range(planted.world)}
        swap[planted.rank], swap[target] = target, planted.rank
        said = "the run's records" if target == planted.rank else \
            f"the records with ranks {planted.rank} and {target} renamed"
        cases.append((said, _renamed(planted.records, swap), target))
    # Step times are equal up to noise: set them to each step's fastest, and order the microseconds
    # left so that the largest goes to a rank that neither waited longest nor is the straggler.
    even = planted.records.copy()
    waits = _medians(even, "t_fwd_bwd")
    order = [planted.rank, int(waits.idxmax())]
    order += [r for r in range(planted.world) if r not in order]
    even["t_step"] = even.groupby("step")["t_step"].transform("min") \
        + even["rank"].map({r: 1e-6 * i for i, r in enumerate(order)})
    cases.append(("the records with step times evened out (they differ by noise only)", even,
                  planted.rank))
    return cases


def _medians(records: pd.DataFrame, column: str) -> pd.Series:
    steps = records[records["step"] >= AFTER]
    return steps.groupby("rank")[column].median()


def _mistakes(world: int) -> dict[str, Callable[[pd.DataFrame, int], int]]:
    """The usual wrong readings, each as (records, the straggler) -> the rank it names."""
    return {"waited": lambda rec, want: int(_medians(rec, "t_fwd_bwd").idxmax()),
            "step time": lambda rec, want: int(_medians(rec, "t_step").idxmax()),
            "plus one": lambda rec, want: want + 1, "minus one": lambda rec, want: want - 1}


def _why(kind: str, answer: int, records: pd.DataFrame, want: int, world: int) -> str:
    """The usual mistake that gives `answer` on these records, in one sentence."""
    waits, times = _medians(records, "t_fwd_bwd"), _medians(records, "t_step")
    if kind == "waited":
        return (f"rank {answer} waited longest (median t_fwd_bwd {waits[answer] * 1e3:.0f} ms, "
                f"the straggler's {waits[want] * 1e3:.0f} ms): it is fast, it waited FOR the "
                "straggler; the straggler arrives last and waits least")
    if kind == "step time":
        return (f"you picked the largest step time, but step times are equal on every rank "
                f"(here {times.min() * 1e3:.1f} to {times.max() * 1e3:.1f} ms): a step ends for "
                "all at the all-reduce, so step time says the job is slow, not who is; split it "
                "into compute and wait")
    if kind in ("plus one", "minus one"):
        return (f"rank {answer} is off by one from rank {want}: ranks count from 0 "
                f"(0..{world - 1}); return the rank as the records name it")
    if kind == "fixed":
        return (f"yours said rank {answer} whatever the records held: read it from the records "
                "(the straggler moved when the ranks were renamed)")
    return f"rank {answer} is not the one the others waited for"


def check_straggler(fn: Callable, *, planted: Planted | None = None, world: int = 3,
                    seed: int | None = None, runs_root: Any = None) -> Report:
    """Plant a straggler in a real run and judge `fn(records) -> rank`:  check_straggler(f).ok."""
    name = getattr(fn, "__name__", "find_straggler")
    report = Report(f"{name}: the straggler, from a real run's records on {world} gloo ranks",
                    implementation=fn)
    for attempt in range(3):   # a run the reference cannot read (a busy machine) is planted again
        if planted is None or attempt:
            try:
                planted = plant_straggler(world=world, runs_root=runs_root,
                                          seed=None if seed is None else seed + attempt)
            except RankFailure as failure:
                return report_failure(report, failure)
        if all(slowest_compute(records) == want for _, records, want in _cases(planted)):
            break
    else:
        report.add("run", "note", "three planted runs were too noisy for labkit's own reading: "
                                  "run the check again on a quieter machine")
        return report
    report.run_dir = planted.run_dir
    report.measured.update({"planted": planted.rank, "records": planted.records})
    cases, answers = _cases(planted), []
    for said, records, want in cases:
        try:
            answer = fn(records.copy())
        except NotImplementedError as error:
            report.add("written", "missing", f"{error or name + ' is not written yet'}: write it "
                                             "in the ✏️ cell and run the check again")
            return report
        except Exception as error:   # the learner's bug: said with the learner's line
            report.add("runs", "fail", f"{said}: your {name} raised {type(error).__name__}: {error}"
                                       + _where(error), part=name)
            return report
        try:
            answers.append(int(answer))
        except (TypeError, ValueError):
            report.add("answer", "fail", f"{said}: your {name} returned {answer!r}, not a rank "
                                         "(an int)", part=name)
            return report
    wrong = [i for i, (answer, (_, _, want)) in enumerate(zip(answers, cases)) if answer != want]
    if wrong:
        said, records, want = cases[wrong[0]]
        kind = next((kind for kind, mistake in _mistakes(planted.world).items()
                     if all(mistake(rec, w) == a for a, (_, rec, w) in zip(answers, cases))),
                    "fixed" if len(set(answers)) == 1 else "")
        report.add("answer", "fail", f"{said}: the straggler is rank {want}; "
                                     + _why(kind, answers[wrong[0]], records, want, planted.world),
                   part=name)
        return report
    report.measured["answer"] = planted.rank
    report.add("answer", "pass", f"rank {planted.rank}, planted at random, was named; and the "
                                 f"straggler was followed to each of the {planted.world} ranks "
                                 "when the records' ranks were renamed")
    return report


def _where(error: BaseException) -> str:
    tb, where = error.__traceback__, ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_learners(code.co_filename) and "-packages" not in code.co_filename:   # not pandas
            where = f" ({Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name})"
        tb = tb.tb_next
    return where
