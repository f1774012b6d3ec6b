"""Batch-size and scaling arithmetic: global batch, scaling efficiency, the linear scaling rule, accumulation.

    from labkit import scaling
    scaling.global_batch(world_size=8, batch_per_rank=32, grad_accum=2)      # 512 samples per optimizer step
    scaling.scaling_efficiency({1: 1000.0, 2: 1800.0, 4: 2000.0})            # {1: 1.0, 2: 0.9, 4: 0.5}
    scaling.linear_scaling_lr(0.1, base_batch=256, batch=8192)               # 3.2: k = 32 times the batch, 32x lr
    scaling.grad_accum_to_fit(global_batch=512, world_size=2, max_batch_per_rank=64)   # 4

Pure functions of numbers: lesson 03 measures the throughputs and losses they are applied to.
"""
from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence


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


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} = {value!r}: must be an integer >= 1")


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
