"""Collective benchmarks and the ring model: how long all_reduce & co. take here, and why.

    from labkit import comm
    df = comm.benchmark(ops=("all_reduce", "broadcast"), sizes=comm.message_sizes(), world_size=2)
    ar = df[df.op == "all_reduce"]
    alpha, bandwidth = comm.fit_ring_model(ar.size_bytes, ar.time_s, world=2)   # seconds, bytes/s
    fig = comm.plot_bandwidth(df)                                               # busbw vs message size

Bandwidths as nccl-tests defines them, in GB/s (1e9 bytes/s), for one collective of S bytes taking t seconds:
    algbw = S / t;  busbw = algbw * factor: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1.
busbw is what each rank's link carried: comparable across ops and world sizes, and against the hardware.
**Size convention**: S is the tensor for all_reduce and broadcast, and the *total, gathered* buffer (n shards of
S/n) for all_gather (its output) and reduce_scatter (its input), as in nccl-tests.

Ring all_reduce model: 2(n-1) steps (reduce-scatter, then all-gather), each moving S/n bytes and paying a
latency alpha:  t = 2(n-1)·alpha + 2(n-1)/n · S/B.  Its busbw tends to B for large S.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from matplotlib.figure import Figure

from ..config import pick
from ..measure.cores import usable_cores
from ..run.launch import launch
from ..run.session import resolve_backend
from ..view import COLORS, new_figure, shown

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
KiB, MiB = 1024, 1024 * 1024
# Small messages take about as long as the skew between ranks leaving a barrier; timing several back-to-back
# calls per repeat (up to 1 MiB in all, as nccl-tests times many iterations) averages that skew away.
CALLS_PER_TIMING = 16
COLUMNS = ["op", "backend", "world_size", "size_bytes", "time_s", "algbw_GBps", "busbw_GBps", "oversubscribed",
           "skipped"]


# --- the arithmetic ------------------------------------------------------------------------------------------

def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for `op` on `world` ranks:  bus_factor("all_reduce", 4) == 1.5."""
    n = _check_world(world)
    if op not in OPS:
        raise ValueError(f"op = {op!r}: must be one of {', '.join(OPS)}")
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)  # gather, scatter: (n-1)/n


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s):  algbw(64 * MiB, 0.05) ≈ 1.34."""
    if not seconds > 0:
        raise ValueError(f"seconds = {seconds!r}: a collective's time must be > 0")
    return size_bytes / seconds / 1e9


def busbw(op: str, size_bytes: float, seconds: float, world: int) -> float:
    """Bus bandwidth in GB/s, as nccl-tests defines it:  busbw("all_reduce", 64 * MiB, 0.05, world=2).

    size_bytes: the tensor (all_reduce, broadcast) or the total gathered buffer (all_gather, reduce_scatter)."""
    return algbw(size_bytes, seconds) * bus_factor(op, world)


def ring_time(size_bytes: Any, world: int, alpha: float, bandwidth: float) -> Any:
    """Ring all_reduce seconds, 2(n-1)·alpha + 2(n-1)/n · S/bandwidth:  ring_time(64 * MiB, 2, 1e-4, 1e9).

    alpha in seconds, bandwidth in bytes/s; size_bytes may be a numpy array."""
    n = _check_world(world)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * np.asarray(size_bytes, dtype=float) / bandwidth


def fit_ring_model(sizes: Sequence[float], times: Sequence[float], world: int) -> tuple[float, float]:
    """(alpha in s, bandwidth in bytes/s) of the ring model that best fits measured all_reduce times.

        alpha, bandwidth = fit_ring_model([4096, 1 << 20, 1 << 24], [2.6e-4, 1.3e-3, 1.7e-2], world=2)

    Linear in alpha and 1/B, so least squares (numpy lstsq), each row divided by its measured time: that minimises
    *relative* errors, so 0.3 ms points count as much as 100 ms ones (plain least squares would fit the largest
    messages and ignore latency). ValueError for unusable data or an unphysical fit (alpha or B not positive)."""
    n = _check_world(world)
    s, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"sizes and times must be 1-D and of equal length (got {s.shape} and {t.shape})")
    if len(np.unique(s)) < 2 or not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(s > 0)):
        raise ValueError("fit_ring_model needs at least two distinct positive sizes and finite times > 0; "
                         f"got sizes={s.tolist()}, times={t.tolist()}")
    design = np.column_stack([np.full_like(s, 2 * (n - 1)), 2 * (n - 1) / n * s]) / t[:, None]
    (alpha, inverse_b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if not (alpha > 0 and inverse_b > 0):
        raise ValueError(f"the ring model does not fit these points: alpha = {alpha:.3g} s, 1/B = {inverse_b:.3g} "
                         "s/byte (both must be > 0). Measure a wider range of sizes (latency-bound and "
                         "bandwidth-bound), or with more repeats if the times are noisy.")
    return float(alpha), float(1.0 / inverse_b)


def relative_errors(sizes: Sequence[float], times: Sequence[float], world: int, alpha: float,
                    bandwidth: float) -> np.ndarray:
    """|model - measured| / measured per point:  np.median(relative_errors(s, t, 2, *fit_ring_model(s, t, 2)))."""
    t = np.asarray(times, dtype=float)
    return np.abs(ring_time(sizes, world, alpha, bandwidth) - t) / t


def ring_prediction(size_bytes: int, world: int, alpha: float, bandwidth: float) -> dict[str, Any]:
    """What the ring model predicts for one all_reduce of `size_bytes` on `world` ranks, as a table row:
    ring_prediction(1 << 20, 8, alpha=1e-4, bandwidth=1e9) -> {"size": "1 MiB", "ranks": 8, "predicted ms": ...}."""
    t = float(ring_time(size_bytes, world, alpha, bandwidth))
    return {"size": human_bytes(size_bytes), "ranks": world, "predicted ms": round(t * 1e3, 3),
            "busbw GB/s": round(busbw("all_reduce", size_bytes, t, world), 3)}


def message_sizes(smallest: int = 4 * KiB, largest: int | None = None, factor: int | None = None) -> list[int]:
    """Powers of `factor` from `smallest` to `largest` bytes: 4 KiB..64 MiB by 2 (quick mode: ..16 MiB by 4).

        message_sizes()  ->  [4096, 8192, ..., 67108864]"""
    largest = largest or pick(full=64 * MiB, quick=16 * MiB)
    factor = factor or pick(full=2, quick=4)
    out = [smallest]
    while out[-1] * factor <= largest:
        out.append(out[-1] * factor)
    return out


def _check_world(world: int) -> int:
    if not isinstance(world, (int, np.integer)) or world < 2:
        raise ValueError(f"world = {world!r}: collectives between ranks need an integer world size >= 2")
    return int(world)


# --- measuring -----------------------------------------------------------------------------------------------

def benchmark(ops: Sequence[str] = OPS, sizes: Sequence[int] | None = None, world_size: int = 2, *,
              repeats: int | None = None, warmup: int = 2, backend: str = "auto", timeout: float = 60.0,
              runs_root: Any = None) -> pd.DataFrame:
    """Time each op at each message size on `world_size` real ranks (one launch for all); a DataFrame of COLUMNS.

        df = benchmark(ops=("all_reduce",), sizes=[4096, 1 << 20], world_size=2, repeats=10)

    Per op and size: `warmup` untimed calls, then `repeats` timings, each after a barrier so that ranks start
    together (messages under 1 MiB: several back-to-back calls per timing, averaged). A timing counts for its
    slowest rank (the collective is done when its last rank is); time_s is the median over repeats.
    backend "auto": nccl on CUDA tensors when every rank can have a GPU, else gloo on CPU tensors. An op the
    backend refuses is not fatal: its rows have NaN times and `skipped` says why. oversubscribed: more ranks
    than usable_cores(), so ranks share cores (label such results)."""
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"ops {unknown}: each must be one of {', '.join(OPS)}")
    sizes = list(sizes or message_sizes())
    repeats = repeats or pick(full=20, quick=15)
    backend = _resolve(backend, _check_world(world_size))
    worker = functools.partial(_bench_rank, ops=tuple(ops), sizes=tuple(sizes), repeats=repeats, warmup=warmup,
                               backend=backend)
    run = launch(worker, world_size=world_size, timeout=timeout, echo=False, progress=False, runs_root=runs_root,
                 name=f"comm-{backend}-w{world_size}")
    df = pd.DataFrame(run.result(0), columns=["op", "size_bytes", "time_s", "skipped"])
    df.insert(1, "backend", backend)
    df.insert(2, "world_size", world_size)
    df["algbw_GBps"] = [algbw(s, t) if t > 0 else np.nan for s, t in zip(df.size_bytes, df.time_s)]
    df["busbw_GBps"] = [busbw(o, s, t, world_size) if t > 0 else np.nan
                        for o, s, t in zip(df.op, df.size_bytes, df.time_s)]
    df["oversubscribed"] = world_size > usable_cores()
    df.attrs["run_path"] = str(run.path)
    return df[COLUMNS]


def _resolve(backend: str, world: int) -> str:
    chosen = resolve_backend(backend, world)
    if chosen == "nccl" and not (dist.is_nccl_available() and torch.cuda.device_count() >= world):
        raise ValueError(f"backend 'nccl' with world_size={world} needs {world} CUDA GPUs and an NCCL build of "
                         f"torch (this one sees {torch.cuda.device_count()}); use backend='gloo' or 'auto'")
    if chosen not in ("gloo", "nccl"):
        raise ValueError(f"backend = {chosen!r}: benchmark runs gloo or nccl. MPI ranks are started by mpirun, "
                         "not by labkit.launch; time them with the same loop under mpirun")
    return chosen


def _bench_rank(ctx: Any, *, ops: tuple[str, ...], sizes: tuple[int, ...], repeats: int, warmup: int,
                backend: str) -> list[tuple[str, int, float, str]] | None:
    """On every rank: time every (op, size); rank 0 returns (op, size_bytes, time_s, skipped) rows."""
    # The launched group is nccl when GPUs allow; a gloo benchmark on such a machine gets a gloo group of its own.
    group = None if backend == ctx.backend else dist.new_group(backend=backend)
    device = ctx.device if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[tuple[str, int, float, str]] = []
    for op in ops:
        calls = [_collective(op, size, ctx.world_size, device, group) for size in sizes]
        skipped = _refused(calls[0][0], device, group)
        medians = [float("nan")] * len(calls)
        if not skipped:
            times = torch.tensor(_time_calls(calls, repeats, warmup, sync, group, ctx.heartbeat),
                                 dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # a call ends when its last rank does
            medians = [statistics.median(per_size) for per_size in times.tolist()]
        for (_, used_bytes), median in zip(calls, medians):
            ctx.record(len(rows), op=op, size_bytes=used_bytes, time_s=median, skipped=skipped)
            rows.append((op, used_bytes, median, skipped))
    return rows if ctx.rank == 0 else None


def _collective(op: str, size_bytes: int, world: int, device: Any, group: Any) -> tuple[Callable[[], Any], int]:
    """A zero-argument call doing `op` on float32 buffers, and the size_bytes it really moves (see module doc)."""
    if op in ("all_reduce", "broadcast"):
        x = torch.ones(max(1, size_bytes // 4), device=device)
        if op == "all_reduce":
            return functools.partial(dist.all_reduce, x, group=group), x.numel() * 4
        return functools.partial(dist.broadcast, x, 0, group=group), x.numel() * 4
    shard = max(1, size_bytes // 4 // world)  # whole shards: S is rounded down to a multiple of n
    small, big = torch.ones(shard, device=device), torch.empty(shard * world, device=device)
    if op == "all_gather":
        return functools.partial(dist.all_gather_into_tensor, big, small, group=group), big.numel() * 4
    return functools.partial(dist.reduce_scatter_tensor, small, big, group=group), big.numel() * 4


def _refused(call: Callable[[], Any], device: Any, group: Any) -> str:
    """Try the op once; "" if every rank ran it, else why not. The ranks agree, so none waits in an op alone.
    (A backend that fails mid-transfer on one rank only would still hang the other: launch's timeout catches it.)"""
    reason = ""
    try:
        call()
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    failed = torch.tensor([1.0 if reason else 0.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    return reason or ("refused on another rank" if failed.item() else "")


def _time_calls(calls: list[tuple[Callable[[], Any], int]], repeats: int, warmup: int, sync: Callable[[], None],
                group: Any, heartbeat: Callable[[], None]) -> list[list[float]]:
    """Seconds per call, [size][repeat]. Each repeat visits every size in turn, so a burst of noise from the rest
    of the machine lands on all sizes alike instead of spoiling one; each timing follows a barrier."""
    for call, _ in calls:
        for _ in range(warmup):
            call()
    sync()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        heartbeat()
        for (call, size_bytes), out in zip(calls, times):
            n = max(1, min(CALLS_PER_TIMING, MiB // size_bytes))
            dist.barrier(group=group)
            sync()
            started = time.perf_counter()
            for _ in range(n):
                call()
            sync()  # CUDA collectives return when queued; the host waits for the GPU before reading the clock
            out.append((time.perf_counter() - started) / n)
    return times


# --- the picture ---------------------------------------------------------------------------------------------

@shown
def plot_bandwidth(df: pd.DataFrame, *, model: bool = True, title: str | None = None) -> Figure:
    """Time (left) and busbw (right) vs message size, one line per op/backend/world; dashed: ring model fits.

        fig = plot_bandwidth(benchmark())      # fig.savefig("busbw.png") outside a notebook"""
    fig = new_figure(figsize=(14, 5))
    ax_t, ax_bw = fig.subplots(1, 2, sharex=True)
    measured = df.dropna(subset=["time_s"])
    for color, ((op, backend, world), g) in zip(COLORS * 4, measured.groupby(["op", "backend", "world_size"])):
        label = f"{op}, {backend}, {world} ranks" + (" (oversubscribed)" if g["oversubscribed"].any() else "")
        g = g.sort_values("size_bytes")
        ax_t.plot(g.size_bytes, g.time_s * 1e3, "o-", color=color, label=label)
        ax_bw.plot(g.size_bytes, g.busbw_GBps, "o-", color=color, label=label)
        if model and op == "all_reduce":
            _draw_model(ax_t, ax_bw, g, int(world), color)
    ax_t.set(title="time of one collective (median over repeats, slowest rank)", ylabel="time (ms)", yscale="log")
    ax_bw.set(title="bus bandwidth (nccl-tests busbw)", ylabel="busbw (GB/s = 1e9 bytes/s)", yscale="log")
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)  # one tick per power of two: the sizes measured
        ax.set_xlabel("message size (all_gather/reduce_scatter: gathered total)")
        ax.xaxis.set_major_formatter(lambda value, _: human_bytes(value))
        ax.yaxis.set_major_formatter(lambda value, _: f"{value:g}")
        ax.grid(alpha=0.3, which="both")
    ax_bw.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    return fig


def _draw_model(ax_t: Any, ax_bw: Any, g: pd.DataFrame, world: int, color: str) -> None:
    try:
        alpha, bandwidth = fit_ring_model(g.size_bytes, g.time_s, world)
    except ValueError:
        return  # nothing physical to draw; the measured points still show
    grid = np.geomspace(g.size_bytes.min(), g.size_bytes.max(), 100)
    predicted = ring_time(grid, world, alpha, bandwidth)
    label = f"ring model, {world} ranks: α = {alpha * 1e6:.0f} µs, B = {bandwidth / 1e9:.2f} GB/s"
    ax_t.plot(grid, predicted * 1e3, "--", color=color, alpha=0.7, label=label)
    ax_bw.plot(grid, grid / predicted / 1e9 * bus_factor("all_reduce", world), "--", color=color, alpha=0.7,
               label=label)


def human_bytes(value: float) -> str:
    """A size as people write it:  human_bytes(4096) -> "4 KiB", human_bytes(3 * MiB / 2) -> "1.5 MiB"."""
    unit, scale = ("MiB", MiB) if value >= MiB else ("KiB", KiB) if value >= KiB else ("B", 1)
    return f"{value / scale:.3g} {unit}"


# --- lesson 02's speed claims: each asserts on a measurement that labkit.measure.gated hands it --------------


def bucket_table(timed: Any, alpha: float, world: int) -> pd.DataFrame:
    """Per bucket_cap_mb of a measure.interleaved of DDP runs that record `allreduces` and `t_step`: all-reduces
    and ms per step (medians over the steps after DDP rebuilt its buckets, the slowest rank), the others' cores,
    and what 2(n-1)·alpha per all-reduce would cost:  bucket_table(timed, alpha=2e-4, world=2)."""
    table = pd.DataFrame({cap: t.run.slowest("allreduces", "t_step", after=2).median() for cap, t in timed.items()}).T
    table = table.rename(columns={"allreduces": "all-reduces per step"}).rename_axis("bucket_cap_mb")
    table["ms per step"] = table.pop("t_step") * 1e3
    table["others' cores"] = [t.others for t in timed.values()]
    table["model: ms of latency"] = table["all-reduces per step"] * 2 * (world - 1) * alpha * 1e3
    return table
