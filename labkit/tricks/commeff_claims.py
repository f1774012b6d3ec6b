"""Lesson 04's claims on counts, bytes, losses and buckets: one function per claim, named after it, reading the runs
and returning (holds, what was measured) for labkit.Claims.check to show in one line:

    from labkit.tricks import commeff_claims as said
    claims.check("no_sync(): one all-reduce per optimizer step", *said.no_sync_allreduces_once(accum_runs))
    claims.gated("small buckets start early", said.small_buckets_start_early, bucket_measured)   # a gated timing

Accumulation runs are keyed (grad_accum, way), way "naive" or "no_sync"; hook runs by label. The functions handed
to `gated` assert (a timing is judged only on quiet cores) and return the measured value as text.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from ..measure import Bound, above, below
from ..records import Run
from .commeff import WARM, bucket_table, powersgd_payload, steps, wire_shares

Result = tuple[bool | Bound, str]   # holds: a Bound (measure.below/above) where a varying number meets its limit


def _per_step(runs: Mapping[Any, Run], column: str) -> dict[str, list]:
    return {_label(key): sorted(steps(run)[column].unique().tolist()) for key, run in runs.items()}


def _label(key: Any) -> str:
    return f"x{key[0]} {key[1]}" if isinstance(key, tuple) else str(key)


def allreduces_each_step(run: Run, expected: int) -> Result:
    """Every optimizer step of a run recorded exactly `expected` all-reduces (the `allreduces` field, every rank)."""
    seen = sorted(run.df["allreduces"].unique().tolist())
    return seen == [expected], f"all-reduces per step: {seen}"


# --- 1 · accumulation --------------------------------------------------------------------------------------------

def every_step_took_the_global_batch(runs: Mapping[Any, Run], global_batch: int) -> Result:
    """Every step of every run put `global_batch` samples through forward and backward (summed over ranks)."""
    seen = sorted({n for values in _per_step(runs, "samples").values() for n in values})
    return seen == [global_batch], f"samples per step: {seen}"


def naive_allreduces_once_per_micro_batch(runs: Mapping[tuple[int, str], Run]) -> Result:
    """The naive runs all-reduced grad_accum times at every step."""
    naive = {key: run for key, run in runs.items() if key[1] == "naive"}
    seen = _per_step(naive, "allreduces")
    return all(seen[_label(key)] == [key[0]] for key in naive), f"per step: {seen}"


def no_sync_allreduces_once(runs: Mapping[tuple[int, str], Run]) -> Result:
    """The no_sync() runs all-reduced once at every step, whatever grad_accum."""
    seen = _per_step({key: run for key, run in runs.items() if key[1] == "no_sync"}, "allreduces")
    return all(values == [1] for values in seen.values()), f"per step: {seen}"


def bytes_follow_the_count(runs: Mapping[tuple[int, str], Run], fp32_bytes: int) -> Result:
    """Each step handed grad_accum fp32 gradients to all-reduce the naive way, one with no_sync()."""
    sent = {_label(key): sorted((steps(run).comm_bytes / fp32_bytes).unique().tolist()) for key, run in runs.items()}
    want = {_label(key): [float(key[0] if key[1] == "naive" else 1)] for key in runs}
    return sent == want, "fp32 gradients per step: " + ", ".join(f"{k} {v[0]:g}" for k, v in sent.items())


def same_loss(runs: Mapping[Any, Run], reference: Any, tol: float) -> Result:
    """Every run's loss, step by step, within `tol` of the reference run's."""
    ref = steps(runs[reference])["loss"]
    gap = max(float((steps(run)["loss"] - ref).abs().max()) for run in runs.values())
    return below(gap, tol, "largest loss gap to the reference"), f"largest gap {gap:.1e} (tolerance {tol:g})"


def loss_fell(runs: Mapping[Any, Run], by: float) -> Result:
    """Every run's loss fell by more than `by` from its first step to its last."""
    fell = {_label(key): float(steps(run)["loss"].iloc[0] - steps(run)["loss"].iloc[-1]) for key, run in runs.items()}
    return above(min(fell.values()), by, "smallest loss fall, first step to last"), \
        f"smallest fall {min(fell.values()):.2f} (need > {by:g})"


def accumulation_cuts_peak_memory(table: pd.DataFrame) -> Result:
    """x8 accumulation's peak memory growth per rank is below x1's (accumulation_table's column)."""
    memory = table["peak memory growth (MB)"]
    x1, x8 = memory.loc[(1, "no_sync")], memory.loc[(8, "no_sync")]
    return below(x8, x1, "x8's peak memory growth (MB), against x1's"), \
        f"x1 {x1:.0f} MB -> x8 {x8:.0f} MB ({x8 / x1:.2f}x)"


# --- 2 · precision: what autocast leaves on the wire ---------------------------------------------------------------

def sends_each_step(runs: Mapping[Any, Run], nbytes: int) -> Result:
    """Every step of every run handed exactly `nbytes` to all-reduce."""
    seen = {label: [b / 2**10 for b in values] for label, values in _per_step(runs, "comm_bytes").items()}
    ok = all(values == [nbytes / 2**10] for values in seen.values())
    return ok, "KiB per step: " + ", ".join(f"{k} {v}" for k, v in seen.items())


# --- 3 · compression hooks -----------------------------------------------------------------------------------------

def torch_bf16_hook_refused(result: str) -> Result:
    """torch's bf16_compress_hook did not register and run (try_torch_bf16_hook's result), unless CUDA is here."""
    return result != "registered and ran" or torch.cuda.is_available(), result.split("\n")[0][:90]


def bytes_per_element(runs: Mapping[str, Run], params: int, widths: Mapping[str, int]) -> Result:
    """Each named run handed `widths[label]` bytes per gradient element to all-reduce at every step."""
    seen = {label: [b / params for b in values] for label, values in _per_step(runs, "comm_bytes").items()
            if label in widths}
    return all(seen[label] == [width] for label, width in widths.items()), ", ".join(f"{k} {v}" for k, v in seen.items())


def powersgd_warms_up_uncompressed(run: Run, fp32_bytes: int, warm: int = WARM) -> Result:
    """PowerSGD's first `warm` steps: one all-reduce of the whole fp32 gradient each."""
    s = steps(run).iloc[:warm]
    ok = bool((s.allreduces == 1).all() and (s.comm_bytes == fp32_bytes).all())
    return ok, f"steps 0-{warm - 1}: {s.allreduces.tolist()} all-reduces, {(s.comm_bytes / fp32_bytes).tolist()} x fp32"


def powersgd_issues_three_collectives(run: Run, warm: int = WARM) -> Result:
    """After its warm-up, PowerSGD issues three collectives per step (uncompressed tensors, P factors, Q factors)."""
    seen = sorted(steps(run).allreduces.iloc[warm:].unique().tolist())
    return seen == [3], f"collectives per step after warm-up: {seen}"


def powersgd_sends_its_prediction(run: Run, shapes: Sequence[torch.Size], rank: int, warm: int = WARM) -> Result:
    """After its warm-up, PowerSGD's bytes per step are exactly commeff.powersgd_payload(shapes, rank)."""
    want, seen = powersgd_payload(shapes, rank), sorted(steps(run).comm_bytes.iloc[warm:].unique().tolist())
    return seen == [want], f"sent {[int(b) for b in seen]} B, predicted {want} B"


def sends_under(run: Run, fp32_bytes: int, fraction: float, warm: int = WARM) -> Result:
    """After the warm-up, every step sends less than `fraction` of an fp32 gradient."""
    most = float(steps(run).comm_bytes.iloc[warm:].max()) / fp32_bytes
    return most < fraction, f"at most {most:.3f} of fp32 (need < {fraction:.3f})"


def sends_less(run: Run, than: Run, warm: int = WARM) -> Result:
    """After the warm-up, `run` sends fewer bytes than `than` at every step."""
    a, b = steps(run).comm_bytes.iloc[warm:], steps(than).comm_bytes.iloc[warm:]
    return bool((a < b).all()), f"{a.max() / 2**10:.1f} KiB vs {b.min() / 2**10:.1f} KiB per step"


def powersgd_lags_the_exact_run(table: pd.DataFrame, exact: str = "allreduce (fp32)") -> Result:
    """Final losses (payload_table): PowerSGD rank 1 above rank 4, above the exact run."""
    final = table["final loss"]
    ratios = [final["PowerSGD r1"] / final["PowerSGD r4"], final["PowerSGD r4"] / final[exact]]   # losses > 0
    return above(np.min(ratios), 1, "final loss, r1 / r4 and r4 / exact (the lesser)"), \
        f"r1 {final['PowerSGD r1']:.3f}, r4 {final['PowerSGD r4']:.3f}, exact {final[exact]:.3f}"


def casts_end_with_the_exact_run(table: pd.DataFrame, tol: float = 0.01, exact: str = "allreduce (fp32)") -> Result:
    """Final losses (payload_table): fp16 and bf16 compression within `tol` of the exact run."""
    final = table["final loss"]
    gaps = {k: abs(final[k] - final[exact]) for k in ("fp16", "bf16")}
    return below(max(gaps.values()), tol, "largest final-loss gap to the exact run"), \
        ", ".join(f"{k} off by {v:.4f}" for k, v in gaps.items())


def fp32_wire_is_a_small_share(measured: Any) -> str:
    """Gated: the whole fp32 all-reduce, timed alone, is under a quarter of an fp32 step (measured: a Metered of
    commeff.wire_and_step)."""
    share = wire_shares(*measured.value)[1].loc["fp32", "share of an fp32 step"]
    assert below(share, 0.25, "fp32 all-reduce / fp32 step time"), share
    return f"{share:.1%} of a step"


# --- 4 · buckets --------------------------------------------------------------------------------------------------

def fewer_allreduces_as_buckets_grow(buckets: pd.DataFrame) -> Result:
    """Per model (bucket_table): all-reduces per step never rise as bucket_cap_mb grows, and fall to one bucket."""
    counts = {size: b["allreduces"].tolist() for size, b in buckets.groupby(level="model")}
    ok = all(c == sorted(c, reverse=True) and c[0] > c[-1] == 1 for c in counts.values())
    return ok, ", ".join(f"{size}: {' -> '.join(f'{n:g}' for n in c)}" for size, c in counts.items())


def small_buckets_start_early(measured: Any) -> str:
    """Gated: with the smallest buckets, the first all-reduce starts before half of backward has run, and earlier
    than with one bucket (measured: a Metered of bucket_timing runs keyed by model)."""
    for size, b in bucket_table(measured.value).groupby(level="model"):
        first = b["first_launch"]
        assert all([below(first.iloc[0], 0.5, f"{size}: first launch, fraction of backward (smallest buckets)"),
                    below(first.iloc[0] / first.iloc[-1], 1,   # the one bucket's launch: late in backward, > 0
                          f"{size}: first launch, smallest buckets / one bucket")]), (size, first)
    return ", ".join(f"{size}: at {b['first_launch'].iloc[0]:.0%} vs {b['first_launch'].iloc[-1]:.0%}"
                     for size, b in bucket_table(measured.value).groupby(level="model"))
