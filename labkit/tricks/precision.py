"""Mixed precision on this machine (lesson 04): what autocast changes (activations), what it does not (the
gradients DDP sends), what it costs here, and what GradScaler did.

    from labkit.tricks import precision
    precision.autocast_facts(cfg, batch_size=16)   # per precision: a layer's output dtype and bytes, bytes kept for
                                                   # backward, gradient dtype (one forward+backward, in this process)
    precision.cpu_16bit_flags()                    # e.g. ['amx_bf16', 'avx512_bf16'], or [] on CPUs without them
    precision.autocast_speed(cfg, batch_size=16)   # ms of a 512x512 matmul and of the model's forward+backward
    precision.run_table({"fp32": run, "fp16": run16})   # DDP runs: times, bytes sent, loss scale, skipped steps
    precision.plot_loss_scale(history)             # a GradScaler's scale per step, skipped steps marked

Nothing here assumes what the CPU can do: the dtypes and bytes are read from the tensors, the times measured.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from ..config import RunConfig
from ..measure import CpuMeter, above, pinned_to
from ..records import Run
from ..training.parallel.held import SavedTensors
from ..training.tasks import make_task
from ..view import COLORS, new_figure, shown
from .commeff import WARM, ms_per_step, steps

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FLAGS_16BIT = {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}


def _autocast(dtype: torch.dtype | None) -> Any:
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def autocast_facts(config: RunConfig, batch_size: int, precisions: tuple[str, ...] = tuple(PRECISIONS)) -> pd.DataFrame:
    """One forward+backward of config's tinylm model per precision, in this process; one row per precision:
    the first MLP layer's output (dtype, shape) and its bytes, the bytes autograd keeps for backward (weights
    excepted, each storage once), the gradients' dtype, the loss:
    autocast_facts(cfg, 16).loc["bf16", "saved for backward (MiB)"]."""
    task = make_task(config.replace(global_batch=batch_size, grad_accum=1), 1)
    inputs, targets = task.batch(0, 0, 0)
    rows = {}
    for name in precisions:
        torch.manual_seed(0)
        model = task.build_model()
        seen: dict[str, Any] = {}

        def note(module: Any, args: Any, out: torch.Tensor) -> None:
            seen.update(dtype=out.dtype, shape=tuple(out.shape), bytes=out.numel() * out.element_size())

        handle = model.transformer.h[0].mlp.c_fc.register_forward_hook(note)
        with _autocast(PRECISIONS[name]), SavedTensors() as saved:
            loss, _ = task.loss(model, inputs, targets)
        held = saved.bytes()   # before backward frees them
        loss.backward()
        handle.remove()
        rows[name] = {"first MLP layer output": f"{seen['dtype']} {seen['shape']}".replace("torch.", ""),
                      "its bytes": seen["bytes"], "saved for backward (MiB)": held / 2**20,
                      "gradient dtype": ", ".join(sorted({str(p.grad.dtype).replace("torch.", "")
                                                          for p in model.parameters()})),
                      "loss": loss.item()}
    return pd.DataFrame(rows).T


def cpu_16bit_flags() -> list[str]:
    """The CPU's bf16/fp16 instruction-set flags, from Linux's /proc/cpuinfo ([] elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(set(line.split(":")[1].split()) & FLAGS_16BIT)


def time_in_turn(fns: Mapping[str, Callable[[], Any]], repeats: int = 9, warmup: int = 2) -> dict[str, float]:
    """Median ms per call of each function; every repeat calls each one in turn, so that noise from the rest of the
    machine lands on all of them alike:  time_in_turn({"a": f, "b": g}). `warmup` untimed rounds first (oneDNN
    builds its kernels on first use)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def autocast_speed(config: RunConfig, batch_size: int = 16, repeats: int = 9) -> pd.DataFrame:
    """ms per call, on one thread (like a rank), of a 512x512 matrix product in fp32 and bf16, and of config's
    model's forward+backward under each precision; plus each one's ratio to fp32:  autocast_speed(cfg)."""
    task = make_task(config.replace(global_batch=batch_size, grad_accum=1), 1)
    torch.manual_seed(0)
    model = task.build_model()
    batch = task.batch(0, 0, 0)
    big = torch.randn(512, 512)

    def matmul(dtype: torch.dtype | None) -> Callable[[], Any]:
        def call() -> Any:
            with _autocast(dtype):
                return big @ big
        return call

    def fwd_bwd(dtype: torch.dtype | None) -> Callable[[], None]:
        def call() -> None:
            with _autocast(dtype):
                loss, _ = task.loss(model, *batch)
            loss.backward()
        return call

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mm = time_in_turn({"fp32": matmul(None), "bf16": matmul(torch.bfloat16)}, repeats)
        model_ms = time_in_turn({name: fwd_bwd(dtype) for name, dtype in PRECISIONS.items()}, repeats)
    finally:
        torch.set_num_threads(threads)
    speed = pd.DataFrame({"512x512 matmul (ms)": mm, f"model fwd+bwd, {batch_size} samples (ms)": model_ms})
    speed["matmul vs fp32"] = speed.iloc[:, 0] / mm["fp32"]
    speed["model vs fp32"] = speed.iloc[:, 1] / model_ms["fp32"]
    return speed


def metered_autocast_speed(config: RunConfig, batch_size: int = 16) -> tuple[pd.DataFrame, float]:
    """autocast_speed on one pinned core, and the cores other programs kept busy there meanwhile (what a gated speed
    claim needs):  speed, others = metered_autocast_speed(cfg)."""
    with pinned_to(1), CpuMeter() as meter:
        started = time.time()
        speed = autocast_speed(config, batch_size)
        ended = time.time()
    return speed, meter.cores_busy(started, ended)[1]


def run_table(runs: Mapping[str, Run], warm: int = WARM) -> pd.DataFrame:
    """Per DDP run: forward+backward and step ms (medians from `warm` on, slowest rank), KiB all-reduced per step
    (counted), steps GradScaler skipped, the loss scale at the last step, final loss:  run_table({"fp16": run})."""
    rows = {}
    for name, run in runs.items():
        s = steps(run)
        rows[name] = {"fwd+bwd ms per step": ms_per_step(run, "t_fwd_bwd", warm), "ms per step": ms_per_step(run, warm=warm),
                      "KiB all-reduced per step": s["comm_bytes"].median() / 2**10,
                      "skipped steps": int(s["skipped_step"].sum()), "last loss scale": s["loss_scale"].iloc[-1],
                      "final loss": s["loss"].iloc[-1]}
    return pd.DataFrame(rows).T


@shown
def plot_loss_scale(history: pd.DataFrame) -> Figure:
    """log2 of a GradScaler's scale per step (index), skipped steps in red, taken steps in green; `history` needs
    columns "scale" and "weights changed" (False where the step was skipped)."""
    fig = new_figure(figsize=(10, 3.5))
    ax = fig.subplots()
    log2 = np.log2(history["scale"].astype(float))
    taken = history["weights changed"].astype(bool)
    ax.step(history.index, log2, where="post", color=COLORS[0], label="log2(scale) at the step")
    ax.scatter(history.index[~taken], log2[~taken], color=COLORS[1], zorder=3, label="overflow: step skipped")
    ax.scatter(history.index[taken], log2[taken], color=COLORS[2], zorder=3, label="step taken")
    ax.set(xlabel="step", ylabel="log2(loss scale)", title="GradScaler on fp16: halve on overflow, grow after clean steps")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


# --- lesson 04's claims on precision: one function per claim, (holds, what was measured) for labkit.Claims.check ---

def output_dtype_is(facts: pd.DataFrame, kind: str, dtype: str) -> tuple[bool, str]:
    """autocast_facts' row `kind`: the first MLP layer's output has `dtype` (e.g. "bfloat16")."""
    seen = facts.loc[kind, "first MLP layer output"]
    return seen.split(" ")[0] == dtype, seen


def bf16_halves_the_layer_output(facts: pd.DataFrame) -> tuple[bool, str]:
    """The layer's output under autocast bf16 holds exactly half the bytes it holds in fp32."""
    bf16, fp32 = facts.loc["bf16", "its bytes"], facts.loc["fp32", "its bytes"]
    return bf16 * 2 == fp32, f"{bf16:,} B vs {fp32:,} B"


def backward_keeps_about_half(facts: pd.DataFrame, low: float = 0.4, high: float = 0.75) -> tuple[bool, str]:
    """Autocast bf16 keeps between `low` and `high` of fp32's bytes for backward (not 0.5: some ops stay fp32)."""
    ratio = facts.loc["bf16", "saved for backward (MiB)"] / facts.loc["fp32", "saved for backward (MiB)"]
    return low < ratio < high, f"{ratio:.2f}x fp32's bytes"


def gradients_stay_fp32(facts: pd.DataFrame) -> tuple[bool, str]:
    """Under every precision the gradients are float32 (the weights are)."""
    seen = facts["gradient dtype"]
    return bool((seen == "float32").all()), ", ".join(f"{k} {v}" for k, v in seen.items())


def small_micro_batch_keeps_less(config: RunConfig, facts: pd.DataFrame, micro: int = 2,
                                 most: float = 0.25) -> tuple[bool, str]:
    """An fp32 micro-batch of `micro` samples keeps under `most` of what the batch behind `facts` keeps for
    backward (accumulation's memory saving, measured like autocast's)."""
    small = autocast_facts(config, batch_size=micro, precisions=("fp32",))
    ratio = small.loc["fp32", "saved for backward (MiB)"] / facts.loc["fp32", "saved for backward (MiB)"]
    return ratio < most, f"{ratio:.2f}x the bytes"


def scaler_only_for_fp16(runs: Mapping[str, Run]) -> tuple[bool, str]:
    """The fp16 run's loss scale stays above 1 at every step; the other runs' is 1 (they have no scaler)."""
    scales = {name: steps(run)["loss_scale"] for name, run in runs.items()}
    ok = all(((s > 1) if name == "fp16" else (s == 1)).all() for name, s in scales.items())
    return bool(ok), ", ".join(f"{name} {s.min():g}..{s.max():g}" for name, s in scales.items())


def autocast_is_slower(timed: tuple[pd.DataFrame, float]) -> str:
    """Gated: autocast bf16 and fp16 both make the model's forward+backward slower than fp32 (a
    metered_autocast_speed measurement)."""
    speed, _ = timed
    bf16, fp16 = speed.loc["bf16", "model vs fp32"], speed.loc["fp16", "model vs fp32"]
    assert all([above(bf16, 1, "fwd+bwd time, bf16 / fp32"), above(fp16, 1, "fwd+bwd time, fp16 / fp32")]), \
        (bf16, fp16)
    return f"bf16 {bf16:.2f}x, fp16 {fp16:.2f}x fp32"


def first_step_overflowed(history: pd.DataFrame) -> tuple[bool, str]:
    """A scaler history (one row per step): the first step found an inf, was skipped, and halved the scale."""
    first = history.iloc[0]
    ok = not first["grads finite"] and not first["weights changed"] and first["scale after"] == first["scale"] / 2
    return bool(ok), f"2**{np.log2(first['scale']):.0f} -> 2**{np.log2(first['scale after']):.0f}"


def steps_taken_exactly_when_finite(history: pd.DataFrame) -> tuple[bool, str]:
    """The weights changed at exactly the steps whose gradients were finite."""
    agree = history["weights changed"] == history["grads finite"]
    return bool(agree.all()), f"{int((~history['grads finite']).sum())} of {len(history)} skipped, all where an inf was"


def every_overflow_halves_the_scale(history: pd.DataFrame) -> tuple[bool, str]:
    """Every step that found an inf left half the scale it started with."""
    hit = history[~history["grads finite"].astype(bool)]
    return bool((hit["scale after"] == hit["scale"] / 2).all()), f"{len(hit)} overflows"


def scale_grew_after_clean_steps(history: pd.DataFrame) -> tuple[bool, str]:
    """Some steps were taken, and the scale grew again after clean steps."""
    taken, grew = int(history["weights changed"].sum()), int((history["scale after"] > history["scale"]).sum())
    return taken > 0 and grew > 0, f"{taken} steps taken, the scale doubled {grew} times"
