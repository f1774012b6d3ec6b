"""Lesson 02's claims and pictures, beside the collectives' science in comm.py: what each collective leaves on each
rank, the ring that all_reduce runs drawn step by step, and the speed checks its gated claims run.

    comm_claims.expected_after([[1, 2], [3, 4]])      # what all_reduce, broadcast, all_gather, reduce_scatter leave
    comm_claims.plot_ring(3)                          # the ring all_reduce, one panel per step
    bench = comm_claims.Shared(metered(run_benchmark, cores=2))   # one measurement several gated claims share
    claims.gated("busbw grows with the message", comm_claims.busbw_grows, bench)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..measure import above, below
from ..view import new_figure, shown
from .comm import _check_world, bucket_table, fit_ring_model, human_bytes, relative_errors


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


def all_reduce_points(df: pd.DataFrame, backend: str = "gloo") -> pd.DataFrame:
    """A benchmark's all_reduce rows for `backend`, smallest message first:  all_reduce_points(benchmark())."""
    return df[(df.op == "all_reduce") & (df.backend == backend)].sort_values("size_bytes")


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
    assert above(growth[least], 4, "least busbw growth, 2 largest / 2 smallest sizes (x)"), growth
    return f"least growth {growth[least]:.0f}x ({least})"


def small_messages_are_latency_bound(bench: Any) -> str:
    """The smallest all_reduce takes over 10x what the fitted bandwidth term alone predicts."""
    points = all_reduce_points(bench.value)
    world = int(points.world_size.iloc[0])
    _, bandwidth = fit_ring_model(points.size_bytes, points.time_s, world)
    smallest = points.iloc[0]
    ratio = smallest.time_s / (2 * (world - 1) / world * smallest.size_bytes / bandwidth)
    assert above(ratio, 10, "smallest all_reduce / its bandwidth term (x)"), (smallest.time_s, ratio)
    return f"{ratio:.0f}x the bandwidth term at {human_bytes(smallest.size_bytes)}"


def ring_model_fits(bench: Any) -> str:
    """The two-parameter ring model fits the measured all_reduce times: median relative error under 50%."""
    points = all_reduce_points(bench.value)
    world = int(points.world_size.iloc[0])
    fit = fit_ring_model(points.size_bytes, points.time_s, world)
    error = float(np.median(relative_errors(points.size_bytes, points.time_s, world, *fit)))
    assert below(error, 0.5, "ring model median relative error"), f"ring model median error {error:.0%}"
    return f"median error {error:.0%}"


def _largest_pair(both: Any) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    few, many = (all_reduce_points(m.value) for m in both)
    return few, many, int(min(few.size_bytes.max(), many.size_bytes.max()))


def more_ranks_take_longer(both: Any) -> str:
    """together(fewer_ranks, more_ranks): the largest all_reduce takes over 1.5x as long with more ranks."""
    few, many, largest = _largest_pair(both)
    t_few, t_many = (float(p.set_index("size_bytes").time_s[largest]) for p in (few, many))
    assert above(t_many / t_few, 1.5, "largest all_reduce time, more ranks / fewer"), (t_many, t_few)
    return f"{t_many / t_few:.1f}x at {human_bytes(largest)}"


def more_ranks_lower_bandwidth(both: Any) -> str:
    """together(fewer_ranks, more_ranks): the ring model fitted with more ranks has a lower B."""
    (few, many, _), fits = _largest_pair(both), []
    for points in (few, many):
        fits.append(fit_ring_model(points.size_bytes, points.time_s, int(points.world_size.iloc[0]))[1])
    assert below(fits[1] / fits[0], 1, "fitted B, more ranks / fewer"), fits   # fit_ring_model: B > 0
    return f"B {fits[1] / 1e9:.2f} vs {fits[0] / 1e9:.2f} GB/s"


def per_tensor_buckets_cost(timed: Any) -> str:
    """Per-tensor DDP buckets (the smallest bucket_cap_mb measured) make the step over 3x slower than the largest
    cap (DDP's default, 25 MB)."""
    table = bucket_table(timed, alpha=0.0, world=2)["ms per step"]
    ratio = table[min(table.index)] / table[max(table.index)]
    assert above(ratio, 3, "step time, smallest bucket cap / largest"), table
    return f"{ratio:.1f}x the default's step"
