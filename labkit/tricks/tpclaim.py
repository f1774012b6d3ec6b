"""Adding tensor parallelism to ZeRO-3, tested: what per-rank memory it changes, and what it costs in time.

The claim (a blog post's "trick"): ZeRO-3 alone still ran out of memory; adding tensor parallelism halved memory
and sped training up by 40%.

    parts = tpclaim.memory_parts(runs)      # per run, fullest rank: model state, gathered parameters, activations
    tpclaim.predicted_parts(runs)           # the same parts, from the formulas (what the measured ones should be)
    tpclaim.memory_bars(parts)              # stacked, beside throughput
    tpclaim.saved_by_module(config)         # what autograd keeps for backward, module by module (units of s·b·h)
    tpclaim.predicted_per_block(config)     # the formula's bytes per block on a rank (also with sequence_parallel)
    tpclaim.tp_comm_share(hidden=12288, tp=8, flops_per_s=989e12, bandwidth=450e9)  # all-reduce / compute time

Activation recomputation (RunConfig.recompute = "full", lesson 27), measured beside its formula:

    again = parallel.run_strategies(tpclaim.recomputed([("fsdp", 2)]), steps=12)   # run "fsdp w2 recompute"
    pairs = tpclaim.paired({**runs, **again})    # {"fsdp w2": (run without, run with)}
    tpclaim.activation_table(pairs)              # bytes kept, measured and by the formula, none beside full
    tpclaim.loss_gap(*pairs["fsdp w2"]), tpclaim.extra_calls(*pairs["fsdp w2"])   # 0.0, {}: same numbers, no gather
    timed = tpclaim.timed_pair(parallel.lesson_config("ddp", 2, steps=12), cores=2)   # side by side, pinned
    tpclaim.slowdown(timed)                      # the median paired step-time ratio, full / none

Model state per rank is 16Ψ/N for ZeRO-3 over N ranks, and (16Ψ/T)/(N/T) for ZeRO-3 over N/T ranks times tensor
parallelism over T: the same. What tensor parallelism cuts is what ZeRO never shards: the activations of the
samples a rank computes on (it computes 1/T of every split layer), and ZeRO-3's gathered layer (1/T of it).
"""
from __future__ import annotations

import re
import statistics
from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..config import RunConfig
from ..measure.mfu import matmul_flops  # noqa: F401 - moved to labkit.measure (MFU); lesson 27 calls it here
from ..measure.timing import Timings, interleaved
from ..records import Run
from ..training.parallel.held import SavedTensors
from ..training.parallel.recompute import recompute_blocks
from ..training.parallel.strategies import COUNTED_STEPS
from ..training.tasks import make_task
from ..view import COLORS, new_figure, shown
from .comm import ring_time
from ..memory import activation_bytes
from .parallel import (STAGE, activation_form, collectives, held, lesson_config, parameter_split,
                       predicted_state, throughput)

FLOPS_PER_LAYER = 72  # fwd + bwd FLOPs per layer ≈ 72·b·s·h² (Narayanan et al. 2021, attention scores left out)


def saved_by_module(config: RunConfig) -> pd.DataFrame:
    """What one forward (and the loss) of config's model keeps for backward, per module: tensors, bytes, and
    bytes in units of s·b·h fp32 values (the activation formula's unit); a block's modules ("h.*") per layer.
    "(loss)" is the cross-entropy outside the model (labkit's act_bytes counts the model's forward only).
    One process, no ranks."""
    task = make_task(config, 1)
    model = task.build_model()
    recompute_blocks(model, config.recompute)   # RunConfig.recompute: as the loop wraps the blocks
    inputs, targets = task.batch(0, 0, 0)
    with SavedTensors(modules=model) as saved:
        loss = task.loss(model, inputs, targets)   # held while counting: it holds the graph
    held = [(re.sub(r"\.h\.\d+(\._checkpoint_wrapped_module)?", ".h.*", name or "(loss)"), size)
            for name, size in saved.held()]
    del loss
    df = pd.DataFrame(held, columns=["module", "bytes"])
    out = df.groupby("module", sort=False).agg(tensors=("bytes", "size"), bytes=("bytes", "sum"))
    per_layer = out.index.str.contains(r"\.h\.\*")
    out["per"] = np.where(per_layer, "layer", "model")
    out.loc[per_layer, ["tensors", "bytes"]] //= len(model.transformer.h)
    out["units_of_sbh"] = out.bytes / (inputs.numel() * model.config.n_embd * 4)  # fp32 values of s·b·h
    return out


def memory_parts(runs: dict[str, Run]) -> pd.DataFrame:
    """Per run, the fullest rank's memory by part (bytes): model state between steps, what ZeRO-3 gathers on top
    during forward, activations; samples each model replica computes on per step; throughput; mesh."""
    rows = {}
    for label, run in runs.items():
        got, config = held(run), run.config
        dp, tp = config.parallel_dims.dp, config.parallel_dims.tp
        rows[label] = {"model_state": got.params + got.grads + got.optimizer,
                       "gathered": got.peak_params - got.params, "activations": got.activations,
                       "samples_per_replica": config.global_batch // dp, "dp": dp, "tp": tp,
                       "samples_per_s": throughput(run)}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out["total"] = out.model_state + out.gathered + out.activations
    return out


def predicted_activations(config: RunConfig, *, layers: int | None = None, **form: Any) -> float:
    """labkit.memory.activation_bytes for config's GPT-2 on this CPU (parallel.activation_form: GPT2_ON_CPU, and
    GPT2_SEQUENCE_PARALLEL with sequence parallelism; `form` changes any of them): the bytes a rank keeps for
    backward, for the samples its model replica computes on:  predicted_activations(cfg, gathered_values=0)."""
    model = make_task(config, 1).build_model().config
    dp, tp = config.parallel_dims.dp, config.parallel_dims.tp
    return activation_bytes(seq=config.seq_len, batch=config.global_batch // dp, hidden=model.n_embd,
                            heads=model.n_head, layers=layers or model.n_layer, tp=tp,
                            **{**activation_form(config), **form})


def predicted_per_block(config: RunConfig, **form: Any) -> float:
    """What the formula says one transformer block keeps on a rank (the part outside the blocks left out)."""
    return predicted_activations(config, layers=2, **form) - predicted_activations(config, layers=1, **form)


def predicted_parts(runs: dict[str, Run]) -> pd.DataFrame:
    """memory_parts' columns from the formulas: model state (tensor parallelism splitting only what it splits),
    what ZeRO-3 gathers on top (one block, its split matrices over T, and the root module's own parameters, 4 bytes
    each), and the activations; samples_per_s is not predicted (NaN)."""
    rows = {}
    for label, run in runs.items():
        config, counts = run.config, parameter_split(run.config)
        tp = config.parallel_dims.tp
        block = (counts["block"] - counts["block_whole"]) / tp + counts["block_whole"]
        rows[label] = {"model_state": predicted_state(config).total,
                       "gathered": 4 * (block + counts["root"]) if STAGE[config.strategy] == 3 else 0.0,
                       "activations": predicted_activations(config), "samples_per_s": np.nan}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out["total"] = out.model_state + out.gathered + out.activations
    return out


@shown
def memory_bars(parts: pd.DataFrame, *, title: str = "ZeRO-3 with and without tensor parallelism") -> Figure:
    """Left: memory per rank by part, stacked; right: throughput, one bar per run."""
    fig = new_figure(figsize=(12, 4.2))
    ax_mem, ax_tp = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    x = np.arange(len(parts))
    bottom = np.zeros(len(parts))
    for part, color in zip(("model_state", "gathered", "activations"), COLORS):
        values = parts[part].to_numpy(float) / 2**20
        ax_mem.bar(x, values, 0.6, bottom=bottom, color=color, label=part.replace("_", " "))
        bottom += values
    labels = [f"{label}\n{row.samples_per_replica:.0f} samples/replica" for label, row in parts.iterrows()]
    ax_mem.set_xticks(x, labels, fontsize=8)
    ax_mem.set(ylabel="MiB per rank (fullest rank)", title="memory per rank, by part")
    ax_mem.legend(fontsize=8)
    ax_tp.bar(x, parts.samples_per_s, 0.6, color=[COLORS[i % len(COLORS)] for i in range(len(parts))])
    ax_tp.set_xticks(x, list(parts.index), fontsize=8)
    ax_tp.set(ylabel="samples / s (all ranks)", title="throughput (median step)")
    for ax in (ax_mem, ax_tp):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    return fig


def step_breakdown(run: Run, *, alpha: float, bandwidth: float, flops_per_s: float) -> dict[str, float]:
    """Seconds of one step of `run`: measured (median), its all-reduces by the ring model (counted calls and bytes,
    over the tensor-parallel group, or the data-parallel one without TP), its matmul FLOPs at `flops_per_s` (72·b·s·h²
    per layer over T, plus 6·b·s·h·V for the LM head; b the samples per replica), and what is left."""
    config = run.config
    dp, tp = config.parallel_dims.dp, config.parallel_dims.tp
    calls, handed = collectives(run).get("all_reduce", (0, 0))
    group = tp if tp > 1 else dp
    reduce_s = float(calls * ring_time(handed / calls, group, alpha, bandwidth)) if calls and group > 1 else 0.0
    model = make_task(config, 1).build_model().config
    tokens = config.global_batch // dp * config.seq_len
    flops = tokens * (FLOPS_PER_LAYER * model.n_embd**2 * model.n_layer / tp + 6 * model.n_embd * model.vocab_size)
    step = config.global_batch / throughput(run)
    return {"step": step, "all_reduces": reduce_s, "matmuls": flops / flops_per_s,
            "everything else": step - reduce_s - flops / flops_per_s}


def tp_comm_share(*, hidden: int, tp: int, flops_per_s: float, bandwidth: float, value_bytes: float = 2) -> float:
    """Time of tensor parallelism's all-reduces over compute time, per layer and step, for a model big enough to be
    bandwidth-bound: 4 all-reduces of s·b·h values (ring: 2(t-1)/t of them on each link) against 72·s·b·h²/t
    FLOPs, which leaves (t-1)·value_bytes·F / (9·h·B):  tp_comm_share(hidden=12288, tp=8, ...)."""
    if tp < 2:
        return 0.0
    comm = 4 * 2 * (tp - 1) / tp * value_bytes / bandwidth          # seconds per s·b·h
    compute = FLOPS_PER_LAYER * hidden / tp / flops_per_s           # seconds per s·b·h
    return comm / compute


def describe(parts: pd.DataFrame, before: str, after: str) -> dict[str, Any]:
    """How `after` compares with `before` (two rows of memory_parts): ratios of each part, of the total, of speed."""
    a, b = parts.loc[before], parts.loc[after]
    ratios = {part: b[part] / a[part] for part in ("model_state", "activations", "total", "samples_per_s")}
    ratios["gathered"] = b.gathered / a.gathered if a.gathered else np.nan
    return ratios

# --- activation recomputation (lesson 27): bytes kept with and without, losses, collectives again, time ----
# The formula is labkit.memory.activation_bytes with recompute="full" (each layer keeps its input, split along
# the sequence under sequence parallelism), as predicted_activations computes it for a run's config.

SUFFIX = " recompute"   # a recomputed run's name: its plain run's name and this


def recomputed(cases: Sequence[tuple]) -> list[tuple]:
    """parallel.run_strategies' cases with recompute="full", each named "<plain name> recompute":
    recomputed([("fsdp", 2)]) == [("fsdp", 2, {"recompute": "full", "name": "fsdp w2 recompute"})]."""
    out = []
    for strategy, world, *more in cases:
        fields = {**(more[0] if more else {}), "recompute": "full"}
        name = lesson_config(strategy, world, steps=1, **{**fields, "recompute": "none"}).name + SUFFIX
        out.append((strategy, world, {**fields, "name": name}))
    return out


def paired(runs: dict[str, Run]) -> dict[str, tuple[Run, Run]]:
    """{plain name: (run without recomputation, run with it)} for every "<name> recompute" run whose plain run is
    in `runs`:  paired({"ddp w2": a, "ddp w2 recompute": b}) == {"ddp w2": (a, b)}."""
    missing = [n for n in runs if n.endswith(SUFFIX) and n[: -len(SUFFIX)] not in runs]
    if missing:
        raise KeyError(f"no plain run for {missing}: run {[n[: -len(SUFFIX)] for n in missing]} too")
    return {n[: -len(SUFFIX)]: (runs[n[: -len(SUFFIX)]], run) for n, run in runs.items() if n.endswith(SUFFIX)}


def activation_table(pairs: dict[str, tuple[Run, Run]]) -> pd.DataFrame:
    """One row per pair: activations the fullest rank kept (act_bytes) without and with recomputation, the
    formula's for both, and the fraction kept (full / none), measured and by the formula."""
    rows = {}
    for label, (none, full) in pairs.items():
        rows[label] = {"measured none": held(none).activations, "measured full": held(full).activations,
                       "formula none": predicted_activations(none.config),
                       "formula full": predicted_activations(full.config)}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out["kept"] = out["measured full"] / out["measured none"]
    out["formula kept"] = out["formula full"] / out["formula none"]
    return out


def worst_gap(table: pd.DataFrame) -> float:
    """The largest |measured / formula - 1| in an activation_table, with and without recomputation."""
    gaps = [(table[f"measured {h}"] / table[f"formula {h}"] - 1).abs().max() for h in ("none", "full")]
    return float(max(gaps))


def losses(run: Run) -> np.ndarray:
    """Every rank's loss on every step, in (step, rank) order."""
    return run.df.dropna(subset=["loss"]).sort_values(["step", "rank"])["loss"].to_numpy(float)


def loss_gap(none: Run, full: Run) -> float:
    """The largest |loss difference| between two runs, step for step and rank for rank (0.0: bit for bit)."""
    a, b = losses(none), losses(full)
    if len(a) != len(b):
        raise ValueError(f"{none.name!r} recorded {len(a)} losses, {full.name!r} {len(b)}: run the same steps")
    return float(np.abs(a - b).max())


def extra_calls(none: Run, full: Run) -> dict[str, int]:
    """Collectives per step that recomputation added on rank 0, by kind (counted at the dispatcher; kinds whose
    calls did not change left out):  extra_calls(tp_sp, tp_sp_recomputed) == {"all_gather": 4, ...}."""
    a, b = collectives(none), collectives(full)
    extra = {k: int(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]) for k in {**a, **b}}
    return {k: v for k, v in sorted(extra.items()) if v}


def extra_bytes(none: Run, full: Run) -> dict[str, int]:
    """Bytes handed to collectives per step that recomputation added on rank 0, by kind (as extra_calls)."""
    a, b = collectives(none), collectives(full)
    extra = {k: int(b.get(k, (0, 0))[1] - a.get(k, (0, 0))[1]) for k in {**a, **b}}
    return {k: v for k, v in sorted(extra.items()) if v}


def timed_pair(config: RunConfig, *, cores: int, rounds: int = 2) -> Timings:
    """config without and with recomputation, timed side by side (measure.interleaved: pinned, metered, the counted
    steps left out of the window); labels config.name and config.name + " recompute"."""
    plain = config.replace(recompute="none")
    variants = {plain.name: plain, plain.name + SUFFIX: plain.replace(recompute="full", name=plain.name + SUFFIX)}
    return interleaved(variants, rounds=rounds, cores=cores, warmup=COUNTED_STEPS + 1)


def slowdown(timed: Timings) -> float:
    """The median over rounds of the recomputed run's step time over the plain run's, measured side by side."""
    plain, full = list(timed)
    return float(statistics.median(timed.paired(full, plain)))


def slowdown_unchecked(timed: Timings) -> str:
    """Why lesson 27 shows recomputation's step time and does not claim it on a machine of a few cores: the reason
    not_checked records, with this launch's ratio. Over five quiet launches of the lesson on a 2-vCPU machine (two
    paired rounds each, tests/margins.md) the ratio was 1.06 to 1.53x: one more forward is real, but one launch's
    ratio can land within a few percent of 1."""
    return (f"this launch: x{slowdown(timed):.2f} per step; over five quiet launches on 2 vCPUs it ranged from 1.06 "
            "to 1.53x: too noisy to claim 'over 5%' with room")


def summary(timed: Timings) -> dict[str, Any]:
    """Milliseconds per step without and with recomputation, and their ratio (slowdown)."""
    plain, full = list(timed)
    return {"ms none": 1e3 * timed[plain].step_s, "ms full": 1e3 * timed[full].step_s, "slower": slowdown(timed)}
