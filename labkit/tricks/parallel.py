"""ZeRO and tensor parallelism, measured: what each strategy makes a rank hold, next to the paper's formulas.

    from labkit.tricks import parallel
    runs = parallel.run_strategies([("ddp", 2), ("zero1", 2), ("fsdp", 2), ("tp", 2), ("fsdp+tp", 4)], steps=12)
    table = parallel.state_table(runs)        # per strategy: bytes measured (fullest rank) beside the formula's
    parallel.state_bars(table)                # the same as a figure
    parallel.megatron_count()                 # all-reduces in forward and backward of tensor-parallel blocks
    parallel.megatron_count(sequence_parallel=True)   # all-gathers and reduce-scatters instead; bytes kept per block
    parallel.run_strategies([("tp", 2, {"sequence_parallel": True})], steps=12)   # the run "tp+sp w2"

The formulas are labkit.memory's (the ZeRO paper's), for this kit's fp32 runs: 4-byte parameters and gradients,
AdamW's K = 8 bytes of state per parameter. `parameter_split` counts which parameters tensor parallelism splits
(the blocks' matrices) and which it keeps whole on every rank (embeddings, LayerNorms, row-wise biases): the
formula's Ψ/T assumes all are split, `predicted_state` does not.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed.fsdp  # noqa: F401 - imported once here, so forked ranks start with it (seconds each)
import torch.distributed.tensor.parallel  # noqa: F401
from matplotlib.figure import Figure

from ..config import RunConfig
from ..measure.bounds import above, below
from ..records import Run
from ..run.launch import launch
from ..training.parallel.dispatchcount import DispatchCounter
from ..training.parallel.held import SavedTensors
from ..training.parallel.strategies import COUNTED_STEPS
from ..training.tasks import make_task
from ..training.parallel.tensor_parallel import block_plan, linear_gpt2, split_blocks
from ..view import COLORS, new_figure, shown
from ..memory import StateBytes, state_breakdown

STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "tp": 0, "fsdp+tp": 3}
FP32_ADAMW = {"param_bytes": 4, "grad_bytes": 4, "k": 8}  # what this kit trains with: fp32 weights, AdamW
PARTS = ("params", "grads", "optimizer")
# labkit.memory.activation_bytes for transformers' GPT-2 as this kit runs it (fp32, dropout 0, the CPU's fused
# attention), in values of s·b·h per layer: the paper's 4 whole and 12 split, where GPT-2 keeps 14 more split ones:
# its GELU, written out in Python (0.5·x·(1 + tanh(...))), keeps 4 tensors of width 4h instead of 1 (+12), and the
# attention kernel keeps q as a view of the fused q|k|v output (all three stay alive) beside contiguous copies of k
# and v (+2). Outside the layers: the final LayerNorm's input and the LM head's input (2). See tpclaim.saved_by_module.
GPT2_ON_CPU = {"value_bytes": 4, "dropout": False, "scores": False, "split_values": 26, "outside_values": 2,
               "norm_stats": True}
# With sequence parallelism (RunConfig.sequence_parallel), torch's DTensor keeps for backward the all-gathered
# inputs of the column-wise layers (the input of q|k|v and of the MLP's first layer: 2 of the 4 whole values per
# layer; Megatron-LM keeps the pieces and gathers again in backward) and the LM head's gathered input (1 of the 2
# outside): those stay whole, the rest is split over the tensor-parallel ranks.
GPT2_SEQUENCE_PARALLEL = {"gathered_values": 2, "outside_gathered_values": 1}


def activation_form(config: RunConfig) -> dict[str, Any]:
    """labkit.memory.activation_bytes' arguments for config's GPT-2 on this CPU, besides its sizes:
    GPT2_ON_CPU, with RunConfig.sequence_parallel GPT2_SEQUENCE_PARALLEL too, and RunConfig.recompute."""
    form = {**GPT2_ON_CPU, "recompute": config.recompute}
    if config.sequence_parallel:
        return {**form, "sequence_parallel": True, **GPT2_SEQUENCE_PARALLEL}
    return form


def lesson_config(strategy: str, world_size: int, *, steps: int, **fields: Any) -> RunConfig:
    """The lesson's run: the tiny GPT-2 (tinylm), 16 samples per step, AdamW:  lesson_config("fsdp", 2, steps=12).
    Named "<strategy> w<world_size>" ("tp+sp w2" with sequence_parallel=True) unless `name` is given."""
    sp = "+sp" if fields.get("sequence_parallel") else ""
    fields = {"global_batch": 16, "lr": 3e-3, "name": f"{strategy}{sp} w{world_size}", **fields}
    return RunConfig(task="tinylm", strategy=strategy, world_size=world_size, steps=steps, **fields)


def run_strategies(cases: Sequence[tuple], *, steps: int, runs_root: Any = None, **fields: Any) -> dict[str, Run]:
    """Train the same model once per (strategy, world_size) or (strategy, world_size, {more fields});
    {"fsdp w2": Run, "tp+sp w2": Run, ...}:  run_strategies([("fsdp", 2), ("tp", 2, {"sequence_parallel": True})],
    steps=12)."""
    runs = {}
    for strategy, world, *more in cases:
        config = lesson_config(strategy, world, steps=steps, **{**fields, **(more[0] if more else {})})
        runs[config.name] = launch(config, echo=False, runs_root=runs_root)
    return runs


# --- what the formulas predict ---------------------------------------------------------------------------------

def parameter_split(config: RunConfig) -> dict[str, int]:
    """Parameters of config's model: total, split by tensor parallelism, kept whole, and those of the largest
    unit ZeRO-3 gathers at once (the root module's own plus one block's)."""
    model = linear_gpt2(make_task(config, 1).build_model())
    split_ids = set()
    for block in model.transformer.h:
        for path, style in block_plan().items():
            module = block.get_submodule(path)
            names = ["weight"] + (["bias"] if type(style).__name__ == "ColwiseParallel" else [])
            split_ids |= {id(getattr(module, n)) for n in names if isinstance(getattr(module, n, None), torch.Tensor)}
    params = list(model.parameters())  # a tied weight appears once
    total = sum(p.numel() for p in params)
    split = sum(p.numel() for p in params if id(p) in split_ids)
    block = max(sum(p.numel() for p in b.parameters()) for b in model.transformer.h)
    block_whole = max(sum(p.numel() for p in b.parameters() if id(p) not in split_ids) for b in model.transformer.h)
    return {"total": total, "split": split, "whole": total - split, "block": block, "block_whole": block_whole,
            "root": total - sum(p.numel() for b in model.transformer.h for p in b.parameters())}


def parameter_tensors(config: RunConfig) -> int:
    """Parameter tensors of config's model as its strategy builds it: tensor parallelism's GPT-2 holds q, k and v
    apart (more tensors). AdamW keeps a 4-byte step counter for each one a rank holds state for."""
    model = make_task(config, 1).build_model()
    return len(list((linear_gpt2(model) if config.parallel_dims.tp > 1 else model).parameters()))


def naive_state(config: RunConfig) -> StateBytes:
    """labkit.memory's formula for config's strategy, on all Ψ parameters (tensor parallelism divides them all)."""
    dp, tp = config.parallel_dims.dp, config.parallel_dims.tp
    return state_breakdown(parameter_split(config)["total"], stage=STAGE[config.strategy], dp=dp, tp=tp,
                           **FP32_ADAMW)


def predicted_state(config: RunConfig) -> StateBytes:
    """The formula with tensor parallelism dividing only what it splits: split/T and whole parts, each then
    divided by the data-parallel formula of config's ZeRO stage."""
    dp, tp = config.parallel_dims.dp, config.parallel_dims.tp
    counts, stage = parameter_split(config), STAGE[config.strategy]
    parts = [state_breakdown(counts["split"], stage=stage, dp=dp, tp=tp, **FP32_ADAMW)]
    if counts["whole"]:
        parts.append(state_breakdown(counts["whole"], stage=stage, dp=dp, tp=1, **FP32_ADAMW))
    return StateBytes(*(sum(getattr(p, part) for p in parts) for part in ("params", "grads", "optimizer")))


# --- what the ranks measured -----------------------------------------------------------------------------------

def held(run: Run) -> pd.Series:
    """Bytes the fullest rank held on the last measured step: params, grads, optimizer, peak params, activations."""
    measured = run.df.dropna(subset=["param_bytes"])
    last = measured[measured.step == measured.step.max()]
    row = last.loc[(last.param_bytes + last.grad_bytes + last.optim_bytes).idxmax()]
    return pd.Series({"params": row.param_bytes, "grads": row.grad_bytes, "optimizer": row.optim_bytes,
                      "peak_params": row.peak_param_bytes, "activations": row.act_bytes,
                      "peak_rss_growth_mb": last.peak_growth_mb.max()})


def throughput(run: Run) -> float:
    """Median global samples/s over the steps after the counted ones (counting collectives slows a step)."""
    steps = run.steps()
    return float(steps[steps.step >= COUNTED_STEPS].samples_per_s.median())


def collectives(run: Run) -> dict[str, tuple[float, float]]:
    """{kind: (calls, bytes handed)} per step on rank 0, from the last step whose collectives were counted (the
    steady state: DDP rebuilds its buckets on step 1 with two extra broadcasts)."""
    df = run.df[run.df["rank"] == 0]
    counted = df.dropna(subset=["allreduces"])
    row = counted[counted.step == counted.step.max()].iloc[0]
    kinds = {c[2:]: (row[c], row[f"bytes_{c[2:]}"]) for c in df.columns if c.startswith("n_") and pd.notna(row[c])}
    return kinds or {"all_reduce": (row.allreduces, row.comm_bytes)}  # "ddp" counts without kinds (commhooks.py)


# Bytes each rank receives, per byte it hands to the collective, with n ranks (ring algorithms, nccl-tests' bus
# factors): an all-reduce of S receives 2(n-1)/n·S; an all-gather of shards s receives the (n-1) others' shards; a
# reduce-scatter of S receives (n-1)/n·S; a broadcast of S, (n-1)/n·S per rank on average (the root receives none).
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: n - 1,
        "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n}


def received_bytes(kind_bytes: dict[str, float], group: int) -> float:
    """Bytes each of `group` ranks receives for collectives that were handed {kind: bytes} (WIRE, ring
    algorithms):  received_bytes({"all_reduce": 2**20}, 2) == 2**20."""
    return float(sum(WIRE[kind](group) * sent for kind, sent in kind_bytes.items())) if group > 1 else 0.0


def collectives_table(runs: dict[str, Run]) -> pd.DataFrame:
    """One row per run and kind of collective: calls per step, bytes handed, bytes each rank receives (WIRE) over
    the group it runs in (data-parallel for FSDP's gathers, tensor-parallel for TP's all-reduces and for sequence
    parallelism's all-gathers and reduce-scatters; under "fsdp+tp" with sequence parallelism both kinds of
    all-gather are counted together, over the data-parallel group)."""
    rows = []
    for label, run in runs.items():
        dp, tp = run.config.parallel_dims.dp, run.config.parallel_dims.tp
        for kind, (calls, handed) in collectives(run).items():
            tp_kind = kind == "all_reduce" or (run.config.sequence_parallel and run.config.strategy == "tp")
            group = tp if (tp_kind and tp > 1 and calls > 1) else dp
            rows.append({"run": label, "kind": kind, "calls": int(calls), "bytes_handed": int(handed),
                         "group": group, "bytes_received": received_bytes({kind: handed}, group)})
    return pd.DataFrame(rows)


def calls_by_run(table: pd.DataFrame) -> dict[str, dict[str, int]]:
    """{run: {kind: calls per step}} from a collectives_table:  calls_by_run(wire)["ddp w2"] == {"all_reduce": 1}."""
    return {label: dict(zip(rows.kind, rows.calls)) for label, rows in table.groupby("run", sort=False)}


def state_table(runs: dict[str, Run]) -> pd.DataFrame:
    """One row per run: measured model state (fullest rank), the formula's (naive and with whole parts), loss."""
    rows = {}
    for label, run in runs.items():
        config = run.config
        measured, naive, predicted = held(run), naive_state(config), predicted_state(config)
        dp, tp = config.parallel_dims.dp, config.parallel_dims.tp
        rows[label] = {"strategy": config.strategy, "dp": dp, "tp": tp, "stage": STAGE[config.strategy],
                       **{f"measured_{p}": measured[p] for p in PARTS},
                       "measured": sum(measured[p] for p in PARTS), "formula": naive.total,
                       "formula_with_whole_parts": predicted.total,
                       **{f"formula_{p}": getattr(predicted, p) for p in PARTS},
                       "peak_params": measured.peak_params, "activations": measured.activations,
                       "peak_rss_growth_mb": measured.peak_rss_growth_mb,
                       "final_loss": run.summary()["final_loss"], "samples_per_s": throughput(run)}
    return pd.DataFrame.from_dict(rows, orient="index")


@shown
def state_bars(table: pd.DataFrame, *, title: str = "model state per rank: measured beside the formula") -> Figure:
    """Per run two stacked bars: measured (solid) and predicted (hatched) parameters, gradients, optimizer state;
    dashed, where FSDP gathers parameters during the step, what the rank holds then."""
    fig = new_figure(figsize=(11, 4.2))
    ax = fig.subplots()
    x = np.arange(len(table))
    for kind, offset, hatch in (("measured", -0.2, None), ("formula", 0.2, "//")):
        bottom = np.zeros(len(table))
        for part, color in zip(PARTS, COLORS):
            values = table[f"{kind}_{part}"].to_numpy(float) / 2**10
            ax.bar(x + offset, values, 0.38, bottom=bottom, color=color, hatch=hatch, alpha=0.9 if hatch else 1,
                   edgecolor="white", label=part if kind == "measured" else None)
            bottom += values
    during = (table.peak_params + table.measured_grads + table.measured_optimizer).to_numpy(float) / 2**10
    gathers = table.peak_params > table.measured_params
    ax.bar((x - 0.2)[gathers], during[gathers], 0.38, fill=False, edgecolor="black", linestyle="--",
           label="during the step (gathered parameters)")
    ax.set_xticks(x, [f"{label}\n(stage {row.stage}, dp {row.dp} x tp {row.tp})" for label, row in table.iterrows()],
                  fontsize=8)
    ax.set(ylabel="KiB per rank", title=f"{title}  (solid: measured, hatched: formula)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


# --- Megatron's claim, counted ---------------------------------------------------------------------------------

def megatron_count(world_size: int = 2, *, sequence_parallel: bool = False, runs_root: Any = None,
                   **fields: Any) -> dict[str, Any]:
    """The collectives one forward and one backward of the tensor-parallel tiny GPT-2 issue (calls, bytes, by
    kind), and what each rank keeps for backward per block and outside the blocks (bytes):
    megatron_count(2), megatron_count(2, sequence_parallel=True)."""
    config = lesson_config("tp", world_size, steps=1, sequence_parallel=sequence_parallel, **fields)
    run = launch(functools.partial(_count_tp_step, config=config), world_size=world_size, echo=False,
                 name="megatron-count", runs_root=runs_root)
    return run.result(0)


def _count_tp_step(ctx: Any, config: RunConfig) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(config.seed)
    task = make_task(config, 1)
    model = split_blocks(linear_gpt2(task.build_model()), init_device_mesh(ctx.device.type, (ctx.world_size,)),
                         sequence_parallel=config.sequence_parallel)
    inputs, targets = task.batch(0, 0, 0)
    counts, blocks = {}, list(model.transformer.h)
    with DispatchCounter() as wire:
        written = written_bytes()
        with SavedByBlock(model) as saved:
            loss, _ = task.loss(model, inputs, targets)
        for phase in ("forward", "backward"):
            if phase == "backward":
                written = written_bytes()
                loss.backward()
            counts[f"{phase}_written"] = written_bytes() - written
            counts[phase], counts[f"{phase}_bytes"] = wire.take()
            kinds = wire.take_kinds()
            counts[f"{phase}_kinds"] = {kind: n for kind, (n, _) in kinds.items()}
            counts[f"{phase}_kind_bytes"] = {kind: sent for kind, (_, sent) in kinds.items()}
    counts.update(blocks=len(blocks), activation_bytes=inputs.numel() * model.config.n_embd * 4,
                  saved_per_block=saved.inside / len(blocks), saved_outside=saved.outside)
    return counts


# Linux's per-process I/O counters; a laptop on macOS or Windows has none, and the wire claims are then not checked.
WIRE_UNMEASURED = (None if os.path.exists("/proc/self/io")
                   else "no /proc/self/io here (Linux only): the bytes each rank wrote could not be read")


def written_bytes() -> int:
    """Bytes this process has written so far (the kernel's `wchar` in /proc/self/io): gloo's sockets, every
    thread. Around a collective with no file writes, the difference is the bytes the rank put on the wire.
    0 where the counter does not exist (WIRE_UNMEASURED says why)."""
    if WIRE_UNMEASURED:
        return 0
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("wchar:")).split()[1])


def wire_check(count: dict[str, Any], group: int) -> dict[str, float]:
    """One forward's bytes a rank wrote to its sockets (measured) beside the ring model's for what it handed to
    collectives (`received_bytes`: a rank sends what its peer receives):  wire_check(megatron_count(2), 2)."""
    return {"written": count["forward_written"], "ring model": received_bytes(count["forward_kind_bytes"], group)}


def writes_the_ring_model(io: dict[str, float]) -> str:
    """Check for claims.checked_unless: the bytes written equal the ring model's within 2% (message headers)."""
    ratio = io["written"] / io["ring model"]
    assert below(abs(ratio - 1), 0.02, "|written / ring model - 1|"), f"wrote {ratio:.3f}x the ring model's bytes"
    return f"{ratio:.3f}x"


def writes_over(factor: float) -> Callable[[tuple[float, float]], str]:
    """Check for claims.checked_unless on (bytes, other bytes): the first over `factor` times the second."""
    def check(pair: tuple[float, float]) -> str:
        ratio = pair[0] / pair[1]
        assert above(ratio, factor, "bytes / bytes compared with"), f"{ratio:.3f}x, not over {factor}x"
        return f"{ratio:.3f}x"
    return check


class SavedByBlock:
    """Bytes autograd keeps for backward during the model's forward (the loss after it left out, as in labkit's
    act_bytes), split into those saved inside its transformer blocks and the rest: this rank's pieces of DTensors,
    weights excepted, each storage once, counted as the `with` is left (held.SavedTensors, labelled by module).
    with SavedByBlock(model) as saved: loss = model(x) ... saved.inside"""

    def __init__(self, model: torch.nn.Module):
        self.model, self.inside, self.outside = model, 0, 0

    def __enter__(self) -> "SavedByBlock":
        self._saved = SavedTensors(modules=self.model).__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._saved.__exit__(*exc)
        for module, size in self._saved.held():   # read now: what ran inside the `with` still holds the graph
            if module is None:
                continue   # outside the model's forward (the loss)
            if _IN_A_BLOCK.match(module):
                self.inside += size
            else:
                self.outside += size


_IN_A_BLOCK = re.compile(r"transformer\.h\.\d+(\.|$)")
