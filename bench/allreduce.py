"""Check labkit.comm's all_reduce bandwidth against a plain dist.all_reduce loop, side by side, at 16 MiB.

    .venv/bin/python bench/allreduce.py                 # 9 rounds, world 2: ~1 min on 2 CPU cores
    .venv/bin/python bench/allreduce.py --rounds 5 --world-size 4 --mib 64

Both sides time the same operation the same way: `WARMUP` untimed calls, then `ITERS` timings, each one call
right after a barrier (labkit.comm times one call per timing from 1 MiB up); a call counts for its slowest rank;
the figure is the median call. What differs is everything around it: labkit's side is labkit.comm.benchmark
(labkit.launch's forked ranks, its group set-up, its records); the plain side shares no code with labkit: its
ranks are started once by multiprocessing (spawn), join over tcp:// on their own and wait for the parent to ask
for a batch of timings. Both run on the same pinned cores with gloo on the loopback interface (labkit's ranks set
GLOO_SOCKET_IFNAME=lo; the plain ranks do too, or gloo may pick the interface the host name resolves to).

Rounds alternate which side goes first, and a round's two batches run seconds apart, so load from the rest of the
machine, which drifts over tens of seconds on a shared machine, lands on both alike; the figure that decides is
the median over rounds of each round's ratio. Each round starts once other programs leave the pinned cores (at
most 10 s of waiting), and the cores they kept busy during each batch are printed beside it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from labkit.measure import CpuMeter, pinned_to
from labkit.measure.cores import wait_for_quiet
from labkit.tricks import comm

WARMUP, ITERS = 3, 20
AGREE = 0.10
QUIET_CORES, QUIET_WAIT_S = 0.25, 10.0  # before each round, wait (at most 10 s) for other programs to leave the cores
REPLY_TIMEOUT_S = 120.0


def plain_rank(rank: int, world: int, port: int, size_bytes: int, conn: Connection) -> None:
    """One rank of the plain loop: its own group; for each ("time", iters) asked, warm up and time `iters` calls,
    each after a barrier, and send back the seconds; ("stop",) ends it."""
    torch.set_num_threads(1)  # as labkit's ranks: one thread each
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as labkit's ranks: the loopback device
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(size_bytes // 4)
    while (ask := conn.recv())[0] == "time":
        for _ in range(WARMUP):
            dist.all_reduce(x)
        seconds = []
        for _ in range(ask[1]):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(x)
            seconds.append(time.perf_counter() - started)
        conn.send(seconds)
    dist.destroy_process_group()


class PlainLoop:
    """`world` plain ranks, started once and kept waiting between batches:  with PlainLoop(2, 16 << 20) as p: p.busbw()."""

    def __init__(self, world: int, size_bytes: int):
        self.world, self.size_bytes = world, size_bytes
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # free now; a race with another process is possible but rare
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=plain_rank, args=(rank, world, port, size_bytes, theirs), daemon=True)
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def busbw(self, iters: int = ITERS) -> float:
        """busbw in GB/s of the median call (slowest rank per call), by the nccl-tests formula (not comm's)."""
        for conn in self.conns:
            conn.send(("time", iters))
        per_rank = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(REPLY_TIMEOUT_S):
                raise TimeoutError(f"plain rank {rank} sent no timings within {REPLY_TIMEOUT_S:.0f} s")
            per_rank.append(conn.recv())
        slowest = [max(call) for call in zip(*per_rank)]
        return self.size_bytes / statistics.median(slowest) / 1e9 * 2 * (self.world - 1) / self.world

    def __enter__(self) -> "PlainLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def labkit_busbw(world: int, size_bytes: int) -> float:
    df = comm.benchmark(ops=("all_reduce",), sizes=[size_bytes], world_size=world, repeats=ITERS, warmup=WARMUP,
                        backend="gloo", runs_root=tempfile.mkdtemp(prefix="bench-allreduce-"))
    return float(df.busbw_GBps.iloc[0])


def metered(meter: CpuMeter, fn: Any, *args: Any) -> tuple[float, float]:
    """(fn(*args), cores other programs kept busy meanwhile on the metered cores)."""
    start = time.time()
    value = fn(*args)
    return value, meter.cores_busy(start, time.time())[1]


def compare(rounds: int, world: int, mib: int, echo: bool = True) -> list[tuple[float, float, float, float]]:
    """Per round (labkit busbw, plain busbw, others' cores during labkit's batch, during the plain one), GB/s."""
    size = mib * 1024 * 1024
    out = []
    cores = min(world, len(os.sched_getaffinity(0)))
    with pinned_to(cores), CpuMeter() as meter, PlainLoop(world, size) as plain:
        plain.busbw(2)  # the group's first calls (connections, buffers) before anything is timed
        for r in range(rounds):
            wait_for_quiet(cores, QUIET_CORES, QUIET_WAIT_S)
            if r % 2:
                theirs, t_others = metered(meter, plain.busbw)
            ours, o_others = metered(meter, labkit_busbw, world, size)
            if not r % 2:
                theirs, t_others = metered(meter, plain.busbw)
            out.append((ours, theirs, o_others, t_others))
            if echo:
                print(f"round {r + 1}: labkit {ours:.3f} GB/s | plain loop {theirs:.3f} GB/s | ratio "
                      f"{ours / theirs:.3f} | others' cores {o_others:.2f} / {t_others:.2f}", flush=True)
    return out


def summarise(rounds: list[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """(median labkit busbw, median plain busbw, median of the per-round ratios)."""
    return (statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds),
            statistics.median(r[0] / r[1] for r in rounds))


RUNS = 3  # make bench shows the agreement holding in this many runs, each its own set of plain ranks and rounds


def rows(quick: bool = True) -> list[tuple[str, float, float, float, str]]:
    """Rows for bench/all.py, (what, labkit, plain loop, ratio, target): busbw at 16 MiB, world 2, in RUNS runs of
    n paired rounds each (a run: fresh plain ranks, the median of its per-round ratios)."""
    n = 5 if quick else 9
    band = f"{1 - AGREE:.1f}-{1 + AGREE:.1f}"
    out = []
    for run in range(1, RUNS + 1):
        measured = compare(n, 2, 16, echo=False)
        a, b, ratio = summarise(measured)
        spread = sorted(r[0] / r[1] for r in measured)
        out.append((f"all_reduce 16 MiB busbw (GB/s), run {run} of {RUNS}, paired in {n} rounds (rounds from "
                    f"{spread[0]:.2f} to {spread[-1]:.2f}): labkit.comm / plain loop", a, b, ratio, band))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mib", type=int, default=16, help="message size in MiB")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    measured = compare(args.rounds, args.world_size, args.mib)
    a, b, ratio = summarise(measured)
    ratios = sorted(r[0] / r[1] for r in measured)
    print(f"\nall_reduce {args.mib} MiB, gloo, world {args.world_size}, busbw (median of {args.rounds} rounds):")
    print(f"  labkit.comm.benchmark  {a:.3f} GB/s")
    print(f"  plain dist.all_reduce  {b:.3f} GB/s")
    verdict = "yes" if abs(ratio - 1) <= AGREE else "NO"
    print(f"  ratio labkit/plain, median of per-round ratios {ratio:.3f} (rounds from {ratios[0]:.3f} to "
          f"{ratios[-1]:.3f})  -> agree within {AGREE:.0%}: {verdict}")


if __name__ == "__main__":
    main()
