"""Communication efficiency (lesson 04): what accumulation, compression and bucket size change, read from runs.

    from labkit.tricks import commeff
    commeff.steps(run)                                  # one row per step: the ranks' collectives and bytes, ...
    commeff.accumulation_table({(8, "naive"): run, ...})   # per (grad_accum, way): all-reduces, KiB, ms per sample
    commeff.payload_table({"fp16": run, ...}, fp32_bytes=4 * commeff.parameter_count(cfg))
    commeff.powersgd_payload(commeff.gradient_shapes(cfg), rank=4)   # what PowerSGD should send after warm-up
    run = launch(functools.partial(commeff.bucket_timing, caps=(0.01, 25.0), steps=8), config=cfg)
    commeff.bucket_table({"tiny": run})                 # all-reduces per step, when the first one starts, ms
    commeff.plot_accumulation(table); commeff.plot_payloads(runs); commeff.plot_buckets(table)

Every count and byte here comes from the records, where labkit.train counted the collectives each rank really
issued and the tensors it handed to them (labkit.training.commhooks). The one formula, powersgd_payload, is a
prediction for the lesson to hold against those counts.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..records import Run
from ..run.launch import launch
from ..training.commhooks import POWERSGD_MIN_COMPRESSION, count_collectives
from ..training.tasks import make_task
from ..view import COLORS, new_figure, shown
from .comm import benchmark

WARM = 2  # steps left out of timings: DDP rebuilds its buckets after step 0; PowerSGD is uncompressed until step 2


def steps(run: Run) -> pd.DataFrame:
    """One row per optimizer step:  commeff.steps(run)[["allreduces", "comm_bytes", "loss"]].

    Times: the slowest rank's (a synchronous step ends with it). allreduces, comm_bytes: what each rank issued, which
    must be the same on every rank (ValueError otherwise: a collective one rank issues alone would hang). samples:
    over all ranks. loss, grad_norm: mean over ranks. loss_scale, skipped_step: as recorded (equal on all ranks)."""
    df = run.df
    g = df.groupby("step")
    for column in ("allreduces", "comm_bytes", "skipped_step"):
        differ = g[column].nunique() > 1
        if differ.any():
            raise ValueError(f"{run.name}: ranks recorded different {column} at steps {list(differ[differ].index)}")
    return pd.DataFrame({"t_step": g["t_step"].max(), "t_fwd_bwd": g["t_fwd_bwd"].max(),
                         "allreduces": g["allreduces"].max(), "comm_bytes": g["comm_bytes"].max(),
                         "samples": g["samples"].sum(), "loss": g["loss"].mean(), "grad_norm": g["grad_norm"].mean(),
                         "loss_scale": g["loss_scale"].max(), "skipped_step": g["skipped_step"].max()})


def ms_per_step(run: Run, column: str = "t_step", warm: int = WARM) -> float:
    """Median over the steps from `warm` on of the slowest rank's `column`, in ms:  ms_per_step(run)."""
    return float(run.slowest(column, after=warm)[column].median() * 1e3)


def accumulation_table(runs: Mapping[tuple[int, str], Run], warm: int = WARM) -> pd.DataFrame:
    """Per (grad_accum, way) run: micro-batch, samples and all-reduces per step, KiB sent, ms per step and sample,
    the ranks' peak memory growth, final loss:  accumulation_table({(8, "naive"): run8, (8, "no_sync"): ...})."""
    rows = []
    for (accum, way), run in runs.items():
        s = steps(run)
        ms = ms_per_step(run, warm=warm)
        rows.append({"grad_accum": accum, "way": way, "micro-batch per rank": run.config.batch_per_rank,
                     "samples per step": int(s["samples"].iloc[0]), "all-reduces per step": int(s["allreduces"].median()),
                     "KiB per step": s["comm_bytes"].median() / 2**10, "ms per step": ms,
                     "ms per sample": ms / s["samples"].iloc[0],
                     "peak memory growth (MB)": run.df["peak_growth_mb"].max(), "final loss": s["loss"].iloc[-1]})
    return pd.DataFrame(rows).set_index(["grad_accum", "way"])


@shown
def plot_accumulation(table: pd.DataFrame) -> Figure:
    """Bytes all-reduced per optimizer step (left) and time per sample (right), one bar per row of
    accumulation_table: blue with no_sync(), red the naive way."""
    fig = new_figure(figsize=(13, 3.8))
    ax_bytes, ax_time = fig.subplots(1, 2)
    labels = [f"x{a} {w}" for a, w in table.index]
    colors = [COLORS[0] if w == "no_sync" else COLORS[1] for _, w in table.index]
    ax_bytes.bar(labels, table["KiB per step"], color=colors)
    ax_bytes.set(title="bytes handed to all-reduce per optimizer step (counted)", ylabel="KiB per step")
    ax_time.bar(labels, table["ms per sample"], color=colors)
    ax_time.set(title="time per sample (median step / samples, slowest rank)", ylabel="ms per sample")
    for ax in (ax_bytes, ax_time):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    return fig


def parameter_count(config: RunConfig) -> int:
    """Parameters of config's model:  4 * parameter_count(cfg) is one fp32 gradient in bytes."""
    return sum(p.numel() for p in make_task(config, 1).build_model().parameters())


def gradient_shapes(config: RunConfig) -> list[torch.Size]:
    """Shapes of config's gradients, in parameter order:  gradient_shapes(cfg)[0]."""
    return [p.shape for p in make_task(config, 1).build_model().parameters()]


def powersgd_payload(shapes: Sequence[torch.Size], rank: int, element_bytes: int = 4) -> int:
    """Bytes PowerSGD should hand to its all-reduces per step once compressing:  powersgd_payload(shapes, rank=4).

    Each gradient is seen as a matrix of shape[0] rows; it is compressed to P (rows x r) and Q (cols x r), with
    r = min(rank, rows, cols), when that at least halves it; 1-D gradients and the rest are sent whole."""
    total = 0
    for shape in shapes:
        numel = int(np.prod(shape))
        if len(shape) <= 1:
            total += numel
            continue
        rows, cols = shape[0], numel // shape[0]
        low_rank = (rows + cols) * min(rank, rows, cols)
        total += low_rank if low_rank * POWERSGD_MIN_COMPRESSION < numel else numel
    return total * element_bytes


def payload_table(runs: Mapping[str, Run], fp32_bytes: int, warm: int = WARM) -> pd.DataFrame:
    """Per hook run: collectives and KiB per step after the warm-up (medians, counted), the ratio to fp32_bytes,
    ms per step, first and final loss:  payload_table({"fp16": run, ...}, fp32_bytes)."""
    rows = {}
    for label, run in runs.items():
        s = steps(run)
        after = s.iloc[warm:]
        rows[label] = {"collectives per step": after["allreduces"].median(),
                       "KiB per step": after["comm_bytes"].median() / 2**10,
                       "vs fp32": after["comm_bytes"].median() / fp32_bytes, "ms per step": ms_per_step(run, warm=warm),
                       "first loss": s["loss"].iloc[0], "final loss": s["loss"].iloc[-1]}
    return pd.DataFrame(rows).T


@shown
def plot_payloads(runs: Mapping[str, Run], warm: int = WARM) -> Figure:
    """Bytes each rank handed to its collectives per step, log scale (left), and the median step time (right)."""
    fig = new_figure(figsize=(13, 3.8))
    ax_bytes, ax_time = fig.subplots(1, 2)
    kib = {label: steps(run)["comm_bytes"] / 2**10 for label, run in runs.items()}
    for (label, sent), style in zip(kib.items(), ("o-", "s-", "x--", "o-", "o-", "o-")):
        ax_bytes.plot(sent.index, sent, style, markersize=4, label=label)
    low, high = (f(f(s[s > 0]) for s in kib.values()) for f in (min, max))
    ax_bytes.set(yscale="log", xlabel="step", ylabel="KiB per step",
                 title="bytes handed to all-reduce (counted; equal payloads overlap)")
    ax_bytes.set_yticks([2.0**k for k in range(int(np.floor(np.log2(low))), int(np.ceil(np.log2(high))) + 1)])
    ax_bytes.yaxis.set_major_formatter(lambda value, _: f"{value:g}")
    ax_bytes.yaxis.set_minor_formatter("")
    ax_bytes.legend(fontsize=8)
    ax_time.bar(list(runs), [ms_per_step(run, warm=warm) for run in runs.values()], color=COLORS[0])
    ax_time.set(ylabel="ms per step", title=f"median step time from step {warm} on (slowest rank)")
    ax_time.tick_params(axis="x", rotation=20)
    for ax in (ax_bytes, ax_time):
        ax.grid(alpha=0.3)
    return fig


def try_torch_bf16_hook(ctx: Any) -> str:
    """Launch target: register torch's bf16_compress_hook on a small DDP model and run one step; what happened."""
    ddp = DDP(torch.nn.Linear(4, 4))
    try:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        ddp(torch.randn(2, 4)).sum().backward()
        return "registered and ran"
    except Exception as exc:  # noqa: BLE001 - what it raises is the point
        return f"{type(exc).__name__}: {exc}"


def _noting_launch(launched, bucket):  # unannotated on purpose: DDP checks a hook's annotations
    """DDP's own all-reduce hook, noting when each bucket's all-reduce is launched."""
    launched.append(time.perf_counter())
    return default_hooks.allreduce_hook(None, bucket)


def bucket_timing(ctx: Any, *, caps: Sequence[float], steps: int) -> None:
    """Launch target: one DDP model of ctx.config's task per bucket cap (MB), trained in turn step by step (so that
    noise from the rest of the machine hits every cap alike):  launch(partial(bucket_timing, caps=..., steps=8),
    config=cfg). Records per (step, cap): t_step, t_backward, allreduces (counted), first_launch and last_launch
    (when the first and last bucket's all-reduce started, as a fraction of backward)."""
    task = make_task(ctx.config, ctx.world_size)
    models = {}
    for cap in caps:
        torch.manual_seed(0)
        model = task.build_model()
        ddp = DDP(model, bucket_cap_mb=cap)
        launched: list[float] = []
        ddp.register_comm_hook(launched, _noting_launch)
        models[cap] = (ddp, launched, torch.optim.AdamW(model.parameters(), lr=ctx.config.lr))
    row = 0
    with count_collectives() as wire:
        for step in range(steps):
            for cap, (ddp, launched, optimizer) in models.items():
                started = time.perf_counter()
                loss, _ = task.loss(ddp, *task.batch(step, 0, ctx.rank))
                launched.clear()
                wire.take()
                backward_started = time.perf_counter()
                loss.backward()
                backward = time.perf_counter() - backward_started
                allreduces, _ = wire.take()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ctx.record(row, cap=cap, step_of_cap=step, loss=loss.item(), samples=task.batch_size,
                           t_step=time.perf_counter() - started, t_backward=backward, allreduces=allreduces,
                           first_launch=(launched[0] - backward_started) / backward,
                           last_launch=(launched[-1] - backward_started) / backward)
                row += 1


def bucket_table(runs: Mapping[str, Run], warm: int = WARM) -> pd.DataFrame:
    """Per (model, cap), from bucket_timing runs keyed by model size: tensors, gradient MiB, all-reduces per step,
    first and last launch (fraction of backward), ms per step and backward; medians over steps from `warm` on,
    each step counted at its slowest rank."""
    parts = []
    for size, run in runs.items():
        later = run.df[run.df["step_of_cap"] >= warm]
        per = (later.groupby(["cap", "step_of_cap"])
               .agg(t_step=("t_step", "max"), t_backward=("t_backward", "max"), allreduces=("allreduces", "max"),
                    first_launch=("first_launch", "median"), last_launch=("last_launch", "median"))
               .groupby("cap").median())
        numels = [int(np.prod(shape)) for shape in gradient_shapes(run.config)]
        per.insert(0, "model", size)
        per.insert(1, "tensors", len(numels))
        per.insert(2, "gradient MiB", sum(numels) * 4 / 2**20)
        parts.append(per)
    table = pd.concat(parts).reset_index().set_index(["model", "cap"])
    table["ms per step"] = table.pop("t_step") * 1e3
    table["ms backward"] = table.pop("t_backward") * 1e3
    return table


@shown
def plot_buckets(table: pd.DataFrame) -> Figure:
    """Step and backward time against bucket_cap_mb (left), and when the first all-reduce starts (right)."""
    fig = new_figure(figsize=(13, 3.8))
    ax_time, ax_start = fig.subplots(1, 2)
    for color, size in zip(COLORS, table.index.get_level_values("model").unique()):
        b = table.loc[size]
        ax_time.plot(b.index, b["ms per step"], "o-", color=color, label=f"{size}: step")
        ax_time.plot(b.index, b["ms backward"], "o--", color=color, label=f"{size}: backward (incl. all-reduces)")
        ax_start.plot(b.index, b["first_launch"] * 100, "o-", color=color, label=f"{size}: first all-reduce launched")
    ax_time.set(xscale="log", xlabel="bucket_cap_mb", ylabel="ms", title="step time vs bucket size (median, slowest rank)")
    ax_time.set_ylim(bottom=0)
    ax_start.set(xscale="log", xlabel="bucket_cap_mb", ylabel="% of backward elapsed", ylim=(0, 105),
                 title="when communication starts")
    for ax in (ax_time, ax_start):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    return fig


def wire_gb(params_millions: float, bytes_per_element: float, grad_accum: int = 8, no_sync: bool = True) -> float:
    """GB one rank hands to all-reduce per optimizer step (the payload, not the ring's traffic):
    wire_gb(7000, 2.0) -> 14.0 for a 7B model with 16-bit gradients."""
    return params_millions * 1e6 * bytes_per_element * (1 if no_sync else grad_accum) / 1e9


def wire_table(per_element: Mapping[str, float], params_millions: Sequence[float] = (125, 1300, 7000),
               grad_accum: int = 8) -> pd.DataFrame:
    """GB per optimizer step for bigger models, naive accumulation and no_sync, from measured bytes per element:
    wire_table({"fp32": 4.0, "fp16": 2.0})."""
    return pd.DataFrame([{"params (M)": p, "hook": hook,
                          f"naive x{grad_accum} (GB/step)": wire_gb(p, b, grad_accum, no_sync=False),
                          f"no_sync x{grad_accum} (GB/step)": wire_gb(p, b, grad_accum, no_sync=True)}
                         for p in params_millions for hook, b in per_element.items()])


@shown
def draw_buckets(layers: int = 8, per_bucket: int = 3, link: float = 0.4) -> Figure:
    """A sketch, not a measurement: backward makes the gradients from the last layer to the first; DDP all-reduces a
    bucket once all its gradients are ready, one bucket after another on the link (top: small buckets; bottom: one
    bucket that waits for the whole backward). `link`: time per layer's gradient on the wire, in layer-times."""
    fig = new_figure(figsize=(11, 3.4))
    axes = fig.subplots(2, 1, sharex=True)
    for ax, group, title in zip(axes, (per_bucket, layers), (f"buckets of {per_bucket} layers", "one bucket")):
        for i in range(layers):
            ax.broken_barh([(i, 0.95)], (1, 0.8), color=COLORS[0])
            ax.text(i + 0.47, 1.4, f"L{layers - i}", ha="center", va="center", fontsize=8, color="white")
        free = 0.0
        for first in range(0, layers, group):
            ready, size = min(first + group, layers), min(group, layers - first)
            start = max(ready, free)           # the link sends one bucket at a time
            free = start + link * size
            ax.broken_barh([(start, free - start - 0.05)], (0, 0.8), color=COLORS[1])
            ax.text((start + free) / 2, 0.4, f"{size} grads", ha="center", va="center", fontsize=7, color="white")
        ax.axvline(free, color="black", linestyle="--", linewidth=1)
        ax.text(free + 0.1, 1.4, "backward()\nreturns", fontsize=7, va="center")
        ax.set(yticks=[0.4, 1.4], yticklabels=["all-reduce", "backward"], title=title, xlim=(0, layers * (1 + link) + 1))
    axes[-1].set_xlabel("time (one layer's backward = 1)")
    return fig


def wire_and_step(config: RunConfig, payloads: Mapping[str, int]) -> tuple[Run, pd.DataFrame, Mapping[str, int]]:
    """A run of `config`, then each payload's all-reduce alone on the same ranks' cores (lesson 02's comm.benchmark):
    run, wire, payloads = wire_and_step(cfg, {"fp32": 4 * params}). Measure it inside labkit.measure.metered."""
    run = launch(config.replace(name="fp32, beside its all-reduce alone"), echo=False, progress=False)
    wire = benchmark(ops=("all_reduce",), sizes=sorted(set(payloads.values())), world_size=config.world_size,
                     repeats=30)
    return run, wire.set_index("size_bytes"), payloads


def wire_shares(run: Run, wire: pd.DataFrame, payloads: Mapping[str, int]) -> tuple[float, pd.DataFrame]:
    """ms per step of the run, and per payload its all-reduce alone (ms) and its share of that step:
    step_ms, table = wire_shares(*wire_and_step(cfg, payloads))."""
    step_ms = ms_per_step(run)
    return step_ms, pd.DataFrame({name: {"KiB": size / 2**10, "all-reduce alone (ms)": wire.time_s[size] * 1e3,
                                         "share of an fp32 step": wire.time_s[size] * 1e3 / step_ms}
                                  for name, size in payloads.items()}).T
