"""Throughput and scaling efficiency of labkit's DDP loop at world sizes 1, 2 and 4, measured side by side.

    .venv/bin/python bench/scaling.py                          # tiny GPT-2, 32 per rank, 3 rounds: ~15 s on 2 cores
    .venv/bin/python bench/scaling.py --batch-per-rank 128 --model-size small --rounds 5 --cores 2

Weak scaling: every world size runs the same batch per rank, so the global batch grows with the world. Each round
runs every world size once, alternating the order (1, 2, 4 then 4, 2, 1, ...) so that drifting load from the rest of
the machine hits all of them alike; the table shows the medians over rounds of each run's median samples/s (steps
after the first, a step counted when its slowest rank ends). Scaling efficiency = throughput_N / (N x throughput_1).
--cores N pins this process and the ranks it forks to the first N cores; world sizes above the usable cores are
labelled oversubscribed (ranks take turns on cores: expect efficiency at or below cores / world). The last line
says how much CPU other programs used meanwhile: on a busy machine every efficiency drops, and the figures are noise.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import psutil

from labkit import RunConfig, launch
from labkit.tricks import scaling
from labkit.tricks.comm import usable_cores


def measure(model_size: str, batch_per_rank: int, world: int, steps: int, runs_root: str) -> tuple[float, float]:
    """(samples/s, tokens/s) of one tinylm run: the medians over its steps after the first."""
    cfg = RunConfig.per_rank(batch_per_rank=batch_per_rank, world_size=world, task="tinylm", model_size=model_size,
                             steps=steps, optimizer="sgd", lr=0.01, tensorboard=False, save_final=False)
    summary = launch(cfg, echo=False, progress=False, runs_root=runs_root).summary()
    return summary["median_samples_per_s"], summary["median_tokens_per_s"]


def busy_cpu_s() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its reaped children)."""
    machine, ours = psutil.cpu_times(), psutil.Process().cpu_times()
    return (machine.user + machine.nice + machine.system + machine.irq + machine.softirq + machine.steal,
            ours.user + ours.system + ours.children_user + ours.children_system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="tiny", choices=("tiny", "small", "base"))
    parser.add_argument("--batch-per-rank", type=int, default=32)
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes; 1 is always included")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None, help="pin to the first N usable cores")
    args = parser.parse_args()
    worlds = sorted({1, *(int(w) for w in args.worlds.split(","))})
    if args.cores:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    cores = usable_cores()
    runs_root = tempfile.mkdtemp(prefix="bench-scaling-")
    samples: dict[int, list[float]] = {w: [] for w in worlds}
    tokens: dict[int, list[float]] = {w: [] for w in worlds}
    started, (machine0, ours0) = time.perf_counter(), busy_cpu_s()
    for rnd in range(args.rounds):
        for world in worlds if rnd % 2 == 0 else worlds[::-1]:
            sps, tps = measure(args.model_size, args.batch_per_rank, world, args.steps, runs_root)
            samples[world].append(sps)
            tokens[world].append(tps)
    machine1, ours1 = busy_cpu_s()
    others = max(0.0, (machine1 - machine0) - (ours1 - ours0)) / (time.perf_counter() - started)
    throughput = {w: statistics.median(v) for w, v in samples.items()}
    efficiency = scaling.scaling_efficiency(throughput)
    print(f"tinylm {args.model_size}, {args.batch_per_rank} per rank, {args.steps} steps x {args.rounds} rounds, "
          f"{cores} usable cores (runs in {runs_root})")
    print(f"{'world':>5} {'global batch':>12} {'samples/s':>10} {'tokens/s':>10} {'speedup':>8} {'efficiency':>10}"
          f"  {'spread of samples/s over rounds':<32}")
    for w in worlds:
        spread = f"{min(samples[w]):.0f}..{max(samples[w]):.0f}"
        label = f"  oversubscribed ({w} ranks on {cores} cores)" if scaling.oversubscribed(w, cores) else ""
        print(f"{w:>5} {scaling.global_batch(w, args.batch_per_rank):>12} {throughput[w]:>10.0f} "
              f"{statistics.median(tokens[w]):>10.0f} {throughput[w] / throughput[1]:>8.2f} {efficiency[w]:>10.2f}"
              f"  {spread:<32}{label}")
    print(f"other programs used {others:.2f} cores on average while this ran"
          + (" (a busy machine: these figures are noisy)" if others >= 0.25 else ""))


if __name__ == "__main__":
    main()
