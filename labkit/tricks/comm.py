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


# --- what each collective leaves on each rank, and the ring that all_reduce runs -----------------------------

def expected_after(starts: Sequence[Sequence[float]]) -> list[dict[str, list[float]]]:
    """What all_reduce, broadcast (from rank 0), all_gather and reduce_scatter (sum) leave on each rank, worked out
    in plain Python from the tensors the ranks started with (one list per rank, equal lengths divisible by n):

        expected_after([[0, 1], [10, 11]])[1]["reduce_scatter"]  ->  [12]   (rank 1's half of the sum)"""
    n = len(starts)
    if n < 2 or len({len(s) for s in starts}) != 1 or len(starts[0]) % n:
        raise ValueError(f"starts: one list per rank (got {n}), all of one length that the {n} ranks divide")
    summed = [float(sum(column)) for column in zip(*starts)]
    chunk = len(summed) // n
    return [{"all_reduce": summed, "broadcast": [float(v) for v in starts[0]],
             "all_gather": [float(v) for s in starts for v in s],
             "reduce_scatter": summed[r * chunk:(r + 1) * chunk]} for r in range(n)]


def ring_allreduce_steps(world: int) -> list[tuple[str, list[list[frozenset[int]]], dict[int, int]]]:
    """The ring all_reduce, step by step, on `world` ranks whose buffers are cut into `world` chunks:
    [(label, held, sent)], held[r][c] = the ranks whose chunk c rank r has summed so far, sent = {rank: chunk it
    sends to rank + 1 in the step that follows}. 2(n-1) steps: n-1 of reduce-scatter, then n-1 of all-gather.

        steps = ring_allreduce_steps(3); steps[-1][1][0][2] == frozenset({0, 1, 2})"""
    n = _check_world(world)
    held = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    plan = [("reduce-scatter", s, {r: (r - s) % n for r in range(n)}) for s in range(n - 1)]
    plan += [("all-gather", s, {r: (r + 1 - s) % n for r in range(n)}) for s in range(n - 1)]
    steps = [("start: each rank its own gradients", [row[:] for row in held], plan[0][2])]
    for number, (phase, s, sent) in enumerate(plan):
        new = [row[:] for row in held]
        for r, c in sent.items():
            to = (r + 1) % n   # reduce-scatter adds what arrives; all-gather copies the finished chunk
            new[to][c] = held[to][c] | held[r][c] if phase == "reduce-scatter" else held[r][c]
        held = new
        following = plan[number + 1][2] if number + 1 < len(plan) else {}
        steps.append((f"step {number + 1}: {phase}", [row[:] for row in held], following))
    return steps


@shown
def plot_ring(world: int = 3) -> Figure:
    """The ring all_reduce as a strip of panels, one per step: a row per rank, a column per chunk of its buffer,
    each cell naming the ranks summed into it (darker: more); the chunk each rank sends next is outlined:
    plot_ring(3)."""
    steps = ring_allreduce_steps(world)
    fig = new_figure(figsize=(2.6 * len(steps), 0.55 * world + 1.4))
    for ax, (label, held, sent) in zip(fig.subplots(1, len(steps)), steps):
        shade = np.array([[len(cell) for cell in row] for row in held], dtype=float)
        ax.imshow(shade, cmap="Blues", vmin=0, vmax=world + 1.5)
        for r, row in enumerate(held):
            for c, cell in enumerate(row):
                ax.text(c, r, "+".join(map(str, sorted(cell))), ha="center", va="center", fontsize=8)
            if r in sent:
                ax.add_patch(_outline(sent[r], r))
        ax.set_xticks(range(world), [f"chunk {c}" for c in range(world)], fontsize=7)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=7)
        ax.set_title(label, fontsize=8)
    fig.suptitle(f"ring all_reduce on {world} ranks: {2 * (world - 1)} steps, each rank sends one chunk (S/{world} "
                 f"bytes) per step; outlined: the chunk it sends to the next rank", fontsize=9)
    return fig


def _outline(chunk: int, rank: int) -> Any:
    from matplotlib.patches import Rectangle
    return Rectangle((chunk - 0.5, rank - 0.5), 1, 1, fill=False, edgecolor="crimson", linewidth=2)


# --- lesson 02's speed claims: each asserts on a measurement that labkit.measure.gated hands it --------------

def all_reduce_points(df: pd.DataFrame, backend: str = "gloo") -> pd.DataFrame:
    """A benchmark's all_reduce rows for `backend`, smallest message first:  all_reduce_points(benchmark())."""
    return df[(df.op == "all_reduce") & (df.backend == backend)].sort_values("size_bytes")


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


class Shared:
    """One measurement that several gated claims check in turn: when one claim has to measure it again (other
    programs were busy), the claims after it start from that fresh measurement instead of measuring once more.

        bench = Shared(metered(run_benchmark, cores=2))
        claims.gated("busbw grows", busbw_grows, bench); claims.gated("the model fits", ring_model_fits, bench)"""

    def __init__(self, measurement: Any):
        self.current = measurement

    @property
    def others(self) -> float:
        return float(self.current.others)

    @property
    def value(self) -> Any:
        return self.current.value

    def again(self) -> "Shared":
        self.current = self.current.again()
        return self

    def wait_for_quiet(self, limit: float, timeout_s: float = 10.0) -> float:
        return self.current.wait_for_quiet(limit, timeout_s)

    def __getitem__(self, index: int) -> Any:
        return self.current[index]


def busbw_grows(bench: Any) -> str:
    """Every op's busbw at the two largest sizes is over 4x its busbw at the two smallest (bench: a Metered
    benchmark table)."""
    growth = {f"{backend} {op}": g.sort_values("size_bytes").busbw_GBps.values
              for (backend, op), g in bench.value.dropna(subset=["time_s"]).groupby(["backend", "op"])}
    growth = {name: bw[-2:].min() / bw[:2].max() for name, bw in growth.items()}
    least = min(growth, key=growth.get)
    assert growth[least] > 4, growth
    return f"least growth {growth[least]:.0f}x ({least})"


def small_messages_are_latency_bound(bench: Any) -> str:
    """The smallest all_reduce takes over 10x what the fitted bandwidth term alone predicts."""
    points = all_reduce_points(bench.value)
    world = int(points.world_size.iloc[0])
    _, bandwidth = fit_ring_model(points.size_bytes, points.time_s, world)
    smallest = points.iloc[0]
    ratio = smallest.time_s / (2 * (world - 1) / world * smallest.size_bytes / bandwidth)
    assert ratio > 10, (smallest.time_s, ratio)
    return f"{ratio:.0f}x the bandwidth term at {human_bytes(smallest.size_bytes)}"


def ring_model_fits(bench: Any) -> str:
    """The two-parameter ring model fits the measured all_reduce times: median relative error under 50%."""
    points = all_reduce_points(bench.value)
    world = int(points.world_size.iloc[0])
    fit = fit_ring_model(points.size_bytes, points.time_s, world)
    error = float(np.median(relative_errors(points.size_bytes, points.time_s, world, *fit)))
    assert error < 0.5, f"ring model median error {error:.0%}"
    return f"median error {error:.0%}"


def _largest_pair(both: Any) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    few, many = (all_reduce_points(m.value) for m in both)
    return few, many, int(min(few.size_bytes.max(), many.size_bytes.max()))


def more_ranks_take_longer(both: Any) -> str:
    """together(fewer_ranks, more_ranks): the largest all_reduce takes over 1.5x as long with more ranks."""
    few, many, largest = _largest_pair(both)
    t_few, t_many = (float(p.set_index("size_bytes").time_s[largest]) for p in (few, many))
    assert t_many > 1.5 * t_few, (t_many, t_few)
    return f"{t_many / t_few:.1f}x at {human_bytes(largest)}"


def more_ranks_lower_bandwidth(both: Any) -> str:
    """together(fewer_ranks, more_ranks): the ring model fitted with more ranks has a lower B."""
    (few, many, _), fits = _largest_pair(both), []
    for points in (few, many):
        fits.append(fit_ring_model(points.size_bytes, points.time_s, int(points.world_size.iloc[0]))[1])
    assert fits[1] < fits[0], fits
    return f"B {fits[1] / 1e9:.2f} vs {fits[0] / 1e9:.2f} GB/s"


def per_tensor_buckets_cost(timed: Any) -> str:
    """Per-tensor DDP buckets (the smallest bucket_cap_mb measured) make the step over 3x slower than the largest
    cap (DDP's default, 25 MB)."""
    table = bucket_table(timed, alpha=0.0, world=2)["ms per step"]
    ratio = table[min(table.index)] / table[max(table.index)]
    assert ratio > 3, table
    return f"{ratio:.1f}x the default's step"
