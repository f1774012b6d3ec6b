"""Batch-size and scaling arithmetic: global batch, scaling efficiency, the linear scaling rule, accumulation.

    from labkit import scaling
    scaling.global_batch(world_size=8, batch_per_rank=32, grad_accum=2)      # 512 samples per optimizer step
    scaling.scaling_efficiency({1: 1000.0, 2: 1800.0, 4: 2000.0})            # {1: 1.0, 2: 0.9, 4: 0.5}
    scaling.linear_scaling_lr(0.1, base_batch=256, batch=8192)               # 3.2: k = 32 times the batch, 32x lr
    scaling.grad_accum_to_fit(global_batch=512, world_size=2, max_batch_per_rank=64)   # 4

The functions above the line are pure functions of numbers; lesson 03 measures the throughputs and losses they are
applied to. Below it, the lesson's table of a measured sweep and its figure:
    table = scaling.sweep_table(measure.interleaved(configs, rounds=3, cores=2), cores=2)
    scaling.plot_scaling(table, cores=2)                                      # throughput | efficiency vs ranks
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..measure import above, below
from ..view import COLORS, new_figure, shown


def global_batch(world_size: int, batch_per_rank: int, grad_accum: int = 1) -> int:
    """global_batch(world_size=2, batch_per_rank=16, grad_accum=4) -> 128: samples per optimizer step.

    Every rank runs `grad_accum` micro-batches of `batch_per_rank` samples before the step (RunConfig.per_rank
    builds a config this way)."""
    for name, value in (("world_size", world_size), ("batch_per_rank", batch_per_rank), ("grad_accum", grad_accum)):
        _check_positive_int(name, value)
    return world_size * batch_per_rank * grad_accum


def scaling_efficiency(throughputs: Mapping[int, float]) -> dict[int, float]:
    """scaling_efficiency({1: 1000.0, 2: 1800.0}) -> {1: 1.0, 2: 0.9}: throughput_N / (N x throughput_1).

    `throughputs` maps world size to measured throughput (samples/s or tokens/s, the same unit for all) at the same
    batch per rank. 1.0 is perfect scaling: N ranks do N times the work of one. World 1 must be measured."""
    if 1 not in throughputs:
        raise ValueError(f"throughputs measured at world sizes {sorted(throughputs)}: scaling efficiency is "
                         "relative to one rank, so include world size 1")
    for world, value in throughputs.items():
        _check_positive_int("world size", world)
        if not (_is_real(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"throughput at world {world} = {value!r}: must be a finite number > 0")
    return {int(world): float(value / (world * throughputs[1])) for world, value in sorted(throughputs.items())}


def speedup(throughputs: Mapping[int, float]) -> dict[int, float]:
    """speedup({1: 1000.0, 2: 1800.0}) -> {1: 1.0, 2: 1.8}: throughput_N / throughput_1 (N x the efficiency)."""
    return {world: world * eff for world, eff in scaling_efficiency(throughputs).items()}


def linear_scaling_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """linear_scaling_lr(0.03, base_batch=32, batch=256) -> 0.24: the LR for `batch` by the linear scaling rule.

    Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): when the global batch grows k times, multiply the learning
    rate by k (and warm it up, see warmup_steps_for). One large step then moves the weights about as far as the k
    small steps it replaces, as long as the gradient changes little over those k steps."""
    if not (_is_real(base_lr) and math.isfinite(base_lr) and base_lr > 0):
        raise ValueError(f"base_lr = {base_lr!r}: must be a finite number > 0")
    _check_positive_int("base_batch", base_batch)
    _check_positive_int("batch", batch)
    return base_lr * batch / base_batch


def warmup_steps_for(samples: int, global_batch: int) -> int:
    """warmup_steps_for(samples=1437, global_batch=256) -> 6: optimizer steps that cover `samples` samples.

    Warmup is best thought of in samples (Goyal et al. warmed up over 5 epochs): the same span takes fewer steps
    at a larger batch. At least one step."""
    _check_positive_int("samples", samples)
    _check_positive_int("global_batch", global_batch)
    return max(1, round(samples / global_batch))


def grad_accum_to_fit(global_batch: int, world_size: int, max_batch_per_rank: int) -> int:
    """grad_accum_to_fit(global_batch=512, world_size=2, max_batch_per_rank=64) -> 4: the fewest micro-batches per
    step that keep the same global batch with at most `max_batch_per_rank` samples on a rank at once.

    The global batch must split evenly over world_size x grad_accum, as RunConfig requires."""
    for name, value in (("global_batch", global_batch), ("world_size", world_size),
                        ("max_batch_per_rank", max_batch_per_rank)):
        _check_positive_int(name, value)
    if global_batch % world_size:
        raise ValueError(f"global_batch = {global_batch} does not split over world_size = {world_size}; "
                         f"use a multiple of {world_size}")
    per_rank = global_batch // world_size
    for accum in range(1, per_rank + 1):
        if per_rank % accum == 0 and per_rank // accum <= max_batch_per_rank:
            return accum
    raise AssertionError("unreachable: accum = per_rank gives a micro-batch of 1")


def loss_near(samples_seen: Sequence[float], loss: Sequence[float], at: float, window: float) -> float:
    """loss_near(steps.samples_seen, steps.loss, at=10_000, window=2_000): the mean loss of the steps whose global
    samples seen lie in (at - window, at].

    Compares runs of different batch sizes at equal samples seen: a small batch records many noisy losses in the
    window, a large batch few smoother ones; the mean over the same window is fair to both."""
    if not (_is_real(window) and window > 0):
        raise ValueError(f"window = {window!r}: must be > 0 samples")
    chosen = [value for seen, value in zip(samples_seen, loss) if at - window < seen <= at]
    if not chosen:
        raise ValueError(f"no step has samples seen in ({at - window:g}, {at:g}]: the run covers "
                         f"{min(samples_seen, default=0):g}..{max(samples_seen, default=0):g}; widen the window")
    return float(sum(chosen) / len(chosen))


def oversubscribed(world_size: int, cores: int) -> bool:
    """oversubscribed(world_size=4, cores=2) -> True: more ranks than CPU cores, so ranks take turns on cores."""
    _check_positive_int("world_size", world_size)
    _check_positive_int("cores", cores)
    return world_size > cores


def layout(world: int, batch_per_rank: int, grad_accum: int = 1, *, base_lr: float, base_batch: int,
           epoch_samples: int) -> dict[str, float]:
    """A data-parallel layout's global batch, its LR by the linear scaling rule from (base_lr, base_batch), and the
    warmup steps that cover one epoch:  layout(8, 32, base_lr=0.03, base_batch=32, epoch_samples=1437)."""
    batch = global_batch(world, batch_per_rank, grad_accum)
    return {"ranks": world, "per rank": batch_per_rank, "accumulation": grad_accum, "global batch": batch,
            "lr (linear rule)": linear_scaling_lr(base_lr, base_batch, batch),
            "warmup steps (1 epoch)": warmup_steps_for(epoch_samples, batch)}


def warmup_ramps(base_lr: float, k: int, warmup_steps: int) -> pd.DataFrame:
    """The two linear warmups to k x base_lr, step by step (one row per warmup step, then the first step after):

        warmup_ramps(0.03, k=8, warmup_steps=6)

    "labkit (from peak/warmup)": labkit's schedule, at peak * (s + 1) / warmup_steps on step s (peak = k x base_lr):
    it starts near zero when warmup_steps is large. "Goyal et al. (from base_lr)": the gradual warmup of Goyal et al.
    2017, which starts at the small batch's rate and adds the same amount each step until it reaches k x base_lr."""
    _check_positive_int("k", k)
    _check_positive_int("warmup_steps", warmup_steps)
    peak = base_lr * k
    steps = range(warmup_steps + 1)
    return pd.DataFrame({"labkit (from peak/warmup)": [peak * min(1.0, (s + 1) / warmup_steps) for s in steps],
                         "Goyal et al. (from base_lr)": [base_lr + (peak - base_lr) * min(1.0, s / warmup_steps)
                                                         for s in steps]},
                        index=pd.RangeIndex(warmup_steps + 1, name="step"))


def replay_one_process(model: Any, batches: Sequence[Any], loss_fn: Any, lr: float) -> list[Any]:
    """Train `model` in one process with plain SGD, one optimizer step per batch of `batches` (each the whole
    global batch of a step), and return its parameters: what a data-parallel run that steps on the same samples
    should end with.  replay_one_process(make_model(), [x0, x1], loss_fn, lr=0.1); loss_fn(model, x) -> loss."""
    import torch
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# --- the lesson's table and figure ---------------------------------------------------------------------------

def sweep_table(timed: Mapping[str, Any], cores: int) -> pd.DataFrame:
    """One row per (model, batch per rank, world) of a measure.Timings of tinylm runs: samples/s and tokens/s (the
    run's median over steps after the first), the slowest rank's forward+backward ms and all-reduced MB per step
    (medians), the peak memory growth, the others' cores, then speedup and efficiency against world 1 of the same
    (model, batch per rank), and how many ranks share a core:  sweep_table(timed, cores=2)."""
    rows = []
    for t in timed.values():
        run, summary = t.run, t.run.summary()
        slowest = run.slowest("t_fwd_bwd", "comm_bytes", after=1).median()
        rows.append({"model": run.config.model_size, "batch per rank": run.config.batch_per_rank,
                     "world": run.world_size, "samples/s": summary["median_samples_per_s"],
                     "tokens/s": summary["median_tokens_per_s"], "fwd_bwd_ms": 1e3 * slowest["t_fwd_bwd"],
                     "allreduce_MB": slowest["comm_bytes"] / 1e6, "peak_growth_mb": run.df["peak_growth_mb"].max(),
                     "others' cores": t.others})
    table = pd.DataFrame(rows).set_index(["model", "batch per rank", "world"]).sort_index()
    for (model, batch), group in table.groupby(level=["model", "batch per rank"]):
        per_world = group["samples/s"].droplevel(["model", "batch per rank"]).to_dict()
        if 1 not in per_world:
            continue                     # efficiency is relative to one rank: none without it
        for world, eff in scaling_efficiency(per_world).items():
            table.loc[(model, batch, world), "speedup"] = per_world[world] / per_world[1]
            table.loc[(model, batch, world), "efficiency"] = eff
    worlds = table.index.get_level_values("world")
    table["global batch"] = [global_batch(w, b) for _, b, w in table.index]
    table["ranks per core"] = [f"{w / cores:g}" + (" (oversubscribed)" if oversubscribed(w, cores) else "")
                               for w in worlds]
    return table


# --- lesson 03's speed claims: each asserts on a measure.Timings that labkit.measure.gated hands it -----------

def _one_rank(timed: Any) -> pd.DataFrame:
    return sweep_table(timed, timed.settings["cores"]).xs(1, level="world")


def larger_batch_more_samples_per_s(timed: Any) -> str:
    """One rank of the tiny model runs over 1.1x the samples/s at 128 per rank than at 8 (fixed costs per step,
    shared by more samples). timed: the sweep's 1-rank runs."""
    speed = _one_rank(timed)["samples/s"]
    ratio = speed["tiny", 128] / speed["tiny", 8]
    assert above(ratio, 1.1, "samples/s, 128 / 8 per rank (tiny, 1 rank)"), speed
    return f"{ratio:.2f}x"


def larger_batch_more_compute_per_mb(timed: Any, mb: pd.Series) -> str:
    """Forward+backward ms per MB all-reduced (mb: MB per step, counted on the 2-rank runs) is over 3x higher at 128
    per rank than at 8, and lower for the small model than for the tiny one at 8 per rank."""
    per_mb = _one_rank(timed)["fwd_bwd_ms"] / mb
    grows, small = per_mb["tiny", 128] / per_mb["tiny", 8], per_mb["small", 8] / per_mb["tiny", 8]
    assert all([above(grows, 3, "fwd+bwd ms per MB all-reduced, 128 / 8 per rank (tiny)"),
                below(small, 1, "fwd+bwd ms per MB all-reduced, small / tiny at 8 per rank")]), per_mb
    return f"{grows:.1f}x at 128 per rank; small/tiny {small:.2f}"


def round_efficiencies(timed: Any, world: int = 2) -> pd.DataFrame:
    """Per (model, batch per rank) of a lesson-03 sweep and per round, the efficiency of `world` ranks against one,
    from the two runs made next to each other in that round (measure.Timings.paired): at the same batch per rank,
    efficiency = one rank's step time / `world` ranks' step time:  round_efficiencies(sweep) -> rows (model,
    batch), one column per round."""
    rows = {}
    for label in timed:
        size, w, _, batch = label.split()
        if int(w) == world and f"{size} 1 x {batch}" in timed:
            rows[(size, int(batch))] = timed.paired(f"{size} 1 x {batch}", label)
    table = pd.DataFrame(rows).T.sort_index()
    table.index.names = ["model", "batch per rank"]
    table.columns = [f"round {r + 1}" for r in table.columns]
    return table


def two_ranks_scale(timed: Any) -> str:
    """2 ranks beat one: the median 2-rank efficiency over the sweep's points and rounds is above 0.5 (a speed-up
    above 1). Each efficiency pairs the 1-rank and 2-rank runs of one round, made next to each other; one point in
    one round swings from about 0.55 to 1.0 on a 2-vCPU virtual machine, the median of them all does not."""
    eff = round_efficiencies(timed)
    median = float(np.median(eff.to_numpy()))
    assert above(median, 0.5, "median 2-rank efficiency, points x rounds"), eff
    spread = f"{eff.min().min():.2f} to {eff.max().max():.2f}"
    return f"median 2-rank efficiency {median:.2f} (each point and round: {spread})"


def oversubscription_costs(timed: Any) -> str:
    """Tiny model, 4 ranks on 2 cores: the efficiency is below 0.9x its 2-rank value at 8 and at 128 per rank."""
    eff = sweep_table(timed, timed.settings["cores"])["efficiency"]
    kept = {b: eff["tiny", b, 4] / eff["tiny", b, 2] for b in (8, 128)}
    assert all([below(share, 0.9, f"efficiency, 4 ranks / 2 ranks at {b} per rank (tiny)")
                for b, share in kept.items()]), eff
    return ", ".join(f"{b} per rank: {share:.2f} of the 2-rank efficiency" for b, share in kept.items())


def large_batch_runs_faster(timed: Any) -> str:
    """Runs B and C (batch 256) both run at over 1.5x the samples/s of run A (batch 32)."""
    speed = {key: t.run.summary()["median_samples_per_s"] for key, t in timed.items()}
    ratio = min(speed["B"], speed["C"]) / speed["A"]
    assert above(ratio, 1.5, "samples/s, min(B, C) / A"), speed
    return f"{ratio:.1f}x"


@shown
def plot_scaling(table: pd.DataFrame, cores: int) -> Figure:
    """Throughput (left, dotted: N x one rank) and scaling efficiency (right) against world size, one line per
    (model, batch per rank) of a sweep_table; world sizes above `cores` shaded:  plot_scaling(table, cores=2)."""
    fig = new_figure(figsize=(13, 4.2))
    ax_tp, ax_eff = fig.subplots(1, 2, sharex=True)
    worlds = sorted(set(table.index.get_level_values("world")))
    for color, ((size, batch), g) in zip(COLORS, table.groupby(level=["model", "batch per rank"])):
        ranks, tp = g.index.get_level_values("world"), g["samples/s"].values
        label = f"{size}, {batch} per rank"
        ax_tp.plot(ranks, tp, "o-", color=color, label=label)
        ax_tp.plot(ranks, tp[0] * np.asarray(ranks), ":", color=color, alpha=0.6)   # perfect scaling
        ax_eff.plot(ranks, g["efficiency"].values, "o-", color=color, label=label)
    for ax in (ax_tp, ax_eff):
        if max(worlds) > cores:
            ax.axvspan(cores + 0.5, max(worlds) + 0.5, color="grey", alpha=0.15,
                       label="oversubscribed: ranks > cores")
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.set_xlabel("world size (ranks)")
        ax.grid(alpha=0.3)
    ax_tp.set(title="throughput (dotted: N x one rank)", ylabel="samples / s (all ranks)", yscale="log")
    ax_eff.set(title="scaling efficiency = throughput_N / (N x throughput_1)", ylabel="efficiency", ylim=(0, 1.1))
    ax_eff.axhline(1.0, color="black", linewidth=0.8)
    ax_eff.legend(fontsize=8)
    return fig


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} = {value!r}: must be an integer >= 1")


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
