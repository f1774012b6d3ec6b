"""Every benchmark in bench/, one command, one table: each row a ratio of two things measured side by side in this run.

    make bench                                   # .venv/bin/python bench/all.py: ~15 min on 2 cores
    make bench BENCH_ARGS=--quick                # fewer samples and rounds: ~9 min
    .venv/bin/python bench/all.py --only launch,allreduce

Sections (each script also runs alone and prints more):
    launch      bench/first_launch.py: fresh Jupyter kernels: the first cell (import labkit) against import torch;
                the import cell plus lesson 00's first launch against a plain fork doing the same work (DDP over
                transformers' tiny GPT-2), torch.multiprocessing.spawn and accelerate's notebook_launcher (the
                `bench` extra); after CUDA was (faked as) initialised, labkit's warm process against a spawn
    loop        bench/launch.py: labkit.train's throughput against a bare DDP loop, launched alternately, in blocks
                of two reversed rounds; where a step's time goes besides the work (cProfile)
    allreduce   bench/allreduce.py: labkit.comm's all_reduce busbw against a plain torch.distributed loop timing the
                same operation, in three runs
    scaling     bench/scaling.py: samples/s at 2 and 4 ranks against N x 1 rank (weak scaling efficiency)
GPU checks are a separate script, for a machine with GPUs: bench/gpu_check.py.

The machine's load average is printed before and after: on a shared machine the absolute figures move a lot, the
ratios (each taken within one run, alternating the sides) much less. A section that fails is reported in the table
and the others still run; the exit status is 1 if any failed.
"""
from __future__ import annotations

import argparse
import math
import operator
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

Row = tuple[str, float, float, float, str]  # what, labkit's figure, the reference's, their ratio, the goal for it


def launch_rows(quick: bool) -> list[Row]:
    import first_launch
    rows = first_launch.rows(first_launch.measure(2 if quick else 3, pause=3.0))
    if first_launch.FAILED_SAMPLES:  # said in the table, not only in the log above it
        rows.append((f"launch: {len(first_launch.FAILED_SAMPLES)} sample(s) failed once and were rerun: "
                     + ", ".join(f.split(":")[0] for f in first_launch.FAILED_SAMPLES), math.nan, math.nan, math.nan, ""))
    return rows


def loop_rows(quick: bool) -> list[Row]:
    import launch
    return launch.overhead_rows(quick)


def allreduce_rows(quick: bool) -> list[Row]:
    import allreduce
    return allreduce.rows(quick)


def scaling_rows(quick: bool) -> list[Row]:
    import scaling
    return scaling.rows(quick)


SECTIONS: dict[str, Callable[[bool], list[Row]]] = {"launch": launch_rows, "loop": loop_rows,
                                                    "allreduce": allreduce_rows, "scaling": scaling_rows}


def met(ratio: float, target: str) -> str:
    """Whether `ratio` meets `target` ("<= 1", "< 1", ">= 0.97", "> 1", "0.9-1.1"): "yes", "NO", or "" (no target
    or no ratio):  met(0.98, ">= 0.97") -> "yes"."""
    target = target.strip()
    if not target or math.isnan(ratio):
        return ""
    for op, holds in (("<=", operator.le), (">=", operator.ge), ("<", operator.lt), (">", operator.gt)):
        if target.startswith(op):
            return "yes" if holds(ratio, float(target[len(op):])) else "NO"
    low, high = (float(v) for v in target.split("-"))
    return "yes" if low <= ratio <= high else "NO"


def table(rows: list[Row]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'measured side by side in this run':<{width}}  {'labkit':>9}  {'reference':>9}  {'ratio':>6}  "
             f"{'goal':<9} met", "-" * (width + 54)]
    for what, ours, theirs, ratio, target in rows:
        cells = "".join(f"  {'' if math.isnan(v) else format(v, '9.3g'):>9}" for v in (ours, theirs))
        lines.append(f"{what:<{width}}{cells}  {'' if math.isnan(ratio) else format(ratio, '6.2f'):>6}  "
                     f"{target:<9} {met(ratio, target)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and rounds")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        parser.error(f"--only {unknown}: choose from {list(SECTIONS)}")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    rows: list[Row] = []
    failed = []
    started = time.perf_counter()
    for name in chosen:
        t0 = time.perf_counter()
        print(f"{name} ...", end=" ", flush=True)
        try:
            rows += SECTIONS[name](args.quick)
            print(f"{time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not hide the others' rows
            failed.append(name)
            rows.append((f"{name}: FAILED ({type(exc).__name__}: {str(exc)[:60]})", math.nan, math.nan, math.nan, ""))
            print(f"failed after {time.perf_counter() - t0:.0f} s\n{traceback.format_exc()}", flush=True)
    print("\n" + table(rows))
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average after: {os.getloadavg()[0]:.2f}; ratio = "
          "labkit / reference; a row 'paired in N rounds' has the median of its per-round ratios)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
