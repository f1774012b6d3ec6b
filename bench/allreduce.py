"""Check labkit.comm's all_reduce bandwidth against a plain dist.all_reduce loop, side by side, at 16 MiB.

    .venv/bin/python bench/allreduce.py                 # 5 rounds each, world 2: ~30 s on 2 CPU cores
    .venv/bin/python bench/allreduce.py --rounds 5 --world-size 4 --mib 64

Rounds alternate which side goes first (labkit then plain, plain then labkit, ...) so drifting machine load
hits both alike; the medians of the rounds
and their ratio are printed, with whether they agree within 10%. The plain side shares no code with labkit: its
ranks are started by torch.multiprocessing.spawn, join over tcp:// on their own, and time a loop of back-to-back
calls (no barrier between them), clocking each call. Per call the slowest rank counts. Its median per call is
the like-for-like figure (labkit reports medians); its mean, as nccl-tests reports, is printed too: on a shared
machine the odd slow call pulls the mean down by several percent.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labkit.tricks import comm

WARMUP, ITERS = 3, 20
AGREE = 0.10


def plain_rank(rank: int, world: int, port: int, size_bytes: int, out_dir: str) -> None:
    """One rank of the plain loop: its own process group, warm-up, then ITERS all_reduces, each clocked."""
    torch.set_num_threads(1)  # as labkit's ranks: one core each, so neither side gets more threads
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(size_bytes // 4)
    for _ in range(WARMUP):
        dist.all_reduce(x)
    dist.barrier()
    seconds = []
    for _ in range(ITERS):
        started = time.perf_counter()
        dist.all_reduce(x)
        seconds.append(time.perf_counter() - started)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seconds))
    dist.destroy_process_group()


def plain_busbw(world: int, size_bytes: int) -> tuple[float, float]:
    """busbw in GB/s of the plain loop from its median and its mean call, by the nccl-tests formula (not comm's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free now; a race with another process is possible but rare
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(plain_rank, args=(world, port, size_bytes, out), nprocs=world, join=True)
        per_rank = [json.loads(p.read_text()) for p in Path(out).glob("rank*.json")]
    slowest = [max(call) for call in zip(*per_rank)]
    factor = 2 * (world - 1) / world
    return (size_bytes / statistics.median(slowest) / 1e9 * factor,
            size_bytes / statistics.mean(slowest) / 1e9 * factor)


def labkit_busbw(world: int, size_bytes: int) -> float:
    df = comm.benchmark(ops=("all_reduce",), sizes=[size_bytes], world_size=world, repeats=ITERS, warmup=WARMUP,
                        backend="gloo", runs_root=tempfile.mkdtemp(prefix="bench-allreduce-"))
    return float(df.busbw_GBps.iloc[0])


def compare(rounds: int, world: int, mib: int, echo: bool = True) -> tuple[list[float], list[float], list[float]]:
    """busbw per round, GB/s: labkit.comm.benchmark, the plain loop's median call, the plain loop's mean call."""
    size = mib * 1024 * 1024
    ours, plain, plain_mean = [], [], []
    for r in range(rounds):
        if r % 2:
            median_bw, mean_bw = plain_busbw(world, size)
        ours.append(labkit_busbw(world, size))
        if not r % 2:
            median_bw, mean_bw = plain_busbw(world, size)
        plain.append(median_bw)
        plain_mean.append(mean_bw)
        if echo:
            print(f"round {r + 1}: labkit {ours[-1]:.3f} GB/s | plain loop {plain[-1]:.3f} GB/s (mean call: "
                  f"{plain_mean[-1]:.3f})")
    return ours, plain, plain_mean


def rows(quick: bool = True) -> list[tuple[str, float, float, float, str]]:
    """Rows for bench/all.py, (what, labkit, plain loop, ratio, target): busbw at 16 MiB, world 2."""
    ours, plain, _ = compare(3 if quick else 5, 2, 16, echo=False)
    a, b = statistics.median(ours), statistics.median(plain)
    return [("all_reduce 16 MiB busbw (GB/s): labkit.comm / plain loop", a, b, a / b,
             f"{1 - AGREE:.1f}-{1 + AGREE:.1f}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mib", type=int, default=16, help="message size in MiB")
    args = parser.parse_args()
    ours, plain, plain_mean = compare(args.rounds, args.world_size, args.mib)
    a, b = statistics.median(ours), statistics.median(plain)
    ratio = a / b
    print(f"\nall_reduce {args.mib} MiB, gloo, world {args.world_size}, busbw (median of {args.rounds} rounds):")
    print(f"  labkit.comm.benchmark  {a:.3f} GB/s")
    print(f"  plain dist.all_reduce  {b:.3f} GB/s   (from its mean call: {statistics.median(plain_mean):.3f} GB/s)")
    verdict = "yes" if abs(ratio - 1) <= AGREE else "NO"
    print(f"  ratio labkit/plain     {ratio:.3f}  -> agree within {AGREE:.0%}: {verdict}")


if __name__ == "__main__":
    main()
