"""Throughput and scaling efficiency of labkit's DDP loop at world sizes 1, 2 and 4, measured side by side.

    .venv/bin/python bench/scaling.py                          # tiny GPT-2, 32 per rank, 3 rounds: ~15 s on 2 cores
    .venv/bin/python bench/scaling.py --batch-per-rank 128 --model-size small --rounds 5 --cores 2

Weak scaling: every world size runs the same batch per rank, so the global batch grows with the world. The world
sizes are timed by labkit.measure.interleaved: each round runs every world size once, alternating the order (1, 2,
4 then 4, 2, 1, ...) so that drifting load from the rest of the machine hits all of them alike, pinned to --cores
cores (default: all this process may use) with a CpuMeter on them. Per world size the run that other programs
disturbed least is kept; its samples/s is the median over its steps after the first (a step counted when its
slowest rank ends). Scaling efficiency = throughput_N / (N x throughput_1). World sizes above the cores are
labelled oversubscribed (ranks take turns on cores: expect efficiency at or below cores / world). The last column
says how many of the pinned cores other programs kept busy during the kept run: the larger, the noisier the figure.
"""
from __future__ import annotations

import argparse
import tempfile
from typing import Any

from labkit import RunConfig
from labkit.measure import interleaved, usable_cores
from labkit.tricks import scaling

OTHERS = "others' cores"


def sweep(model_size: str, batch_per_rank: int, worlds: list[int], steps: int, rounds: int,
          cores: int) -> tuple[Any, Any, str]:
    """Every world size, interleaved and pinned: the table (samples/s, speedup, efficiency per world), the timing."""
    runs_root = tempfile.mkdtemp(prefix="bench-scaling-")
    timed = interleaved({f"{w} ranks": RunConfig.per_rank(
        batch_per_rank=batch_per_rank, world_size=w, task="tinylm", model_size=model_size,
        steps=steps, optimizer="sgd", lr=0.01, tensorboard=False, save_final=False) for w in worlds},
        rounds=rounds, cores=cores, warmup=1, runs_root=runs_root)
    return scaling.sweep_table(timed, cores).droplevel(["model", "batch per rank"]), timed, runs_root


def rows(quick: bool = True) -> list[tuple[str, float, float, float, str]]:
    """Rows for bench/all.py, (what, samples/s at N ranks, N x samples/s at 1 rank, efficiency, target)."""
    cores = usable_cores()
    table, _, _ = sweep("tiny", 32, [1, 2, 4], 10, 2 if quick else 3, cores)
    one = table.loc[1, "samples/s"]
    out = []
    for w in (2, 4):
        label = f", oversubscribed on {cores} cores" if scaling.oversubscribed(w, cores) else ""
        out.append((f"scaling, {w} ranks{label} (samples/s): {w} ranks / {w} x 1 rank", table.loc[w, "samples/s"],
                    w * one, table.loc[w, "efficiency"], f"<= {min(1.0, cores / w):.2f}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="tiny", choices=("tiny", "small", "base"))
    parser.add_argument("--batch-per-rank", type=int, default=32)
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes; 1 is always included")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None, help="pin to the first N usable cores (default: all)")
    args = parser.parse_args()
    worlds = sorted({1, *(int(w) for w in args.worlds.split(","))})
    cores = args.cores or usable_cores()
    table, timed, runs_root = sweep(args.model_size, args.batch_per_rank, worlds, args.steps, args.rounds, cores)
    print(f"tinylm {args.model_size}, {args.batch_per_rank} per rank, {args.steps} steps x {args.rounds} rounds, "
          f"pinned to {cores} cores (runs in {runs_root})")
    print(f"{'world':>5} {'global batch':>12} {'samples/s':>10} {'tokens/s':>10} {'speedup':>8} {'efficiency':>10}"
          f" {'others (cores)':>14}")
    for w, row in table.iterrows():
        label = f"  oversubscribed ({w} ranks on {cores} cores)" if scaling.oversubscribed(w, cores) else ""
        print(f"{w:>5} {row['global batch']:>12} {row['samples/s']:>10.0f} {row['tokens/s']:>10.0f} "
              f"{row['speedup']:>8.2f} {row['efficiency']:>10.2f} {row.loc[OTHERS]:>14.2f}{label}")
    if timed.others >= 0.3:
        print(f"other programs kept up to {timed.others:.2f} of the pinned cores busy: these figures are noisy")


if __name__ == "__main__":
    main()
