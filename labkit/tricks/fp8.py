"""FP8 as DeepSeek-V3 trains with it, measured: the formats, scaling against outliers, training, the wire.

    from labkit.tricks import fp8
    fp8.formats_table()                  # E4M3, E5M2 (and BF16) read from all their bit patterns
    fp8.roundtrip(x, tile=16)            # quantisation error per format and granularity, against the bound
    fp8.outlier_case()                   # one activation of 1e5: per-tensor vs 1 x 128 / 128 x 128 scaling
    fp8.scaled_mm_check()                # the simulated FP8 GEMM against torch._scaled_mm on this CPU
    fp8.torchao_check(steps=8)           # torchao's Float8Linear against labkit's simulation, trained side by side
    fp8.model_tensors(cfg)               # the tiny model's own activations, weights and gradients, quantised
    runs = fp8.train({"fp32": {}, "fp8 tile": {"precision": "fp8"}}, steps=20)
    fp8.loss_table(runs)                 # final losses and the gaps to fp32 and bf16, beside V3's 0.25%
    fp8.dispatch_check()                 # 2 ranks: the expert dispatch in fp32 and in FP8, bytes counted
    fp8.wire_traffic(run)                # an expert-parallel run's all_to_all bytes against the formula

Everything here is numerics: quantising, rounding, bytes. The CPU runs FP8 as a simulation (quantise, compute in
fp32), so time measured here says nothing about FP8's speed on a GPU's tensor cores.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..config import RunConfig
from ..constraints import torchao_available
from ..records import Run
from ..run.launch import launch
from ..training.fp8 import FORMATS, error_bound, fake_quantise, quantise, relative_error
from ..training.fp8_layers import apply_fp8, candidates, is_fp8, kept
from ..training.fp8_linear import FP8Matmul, Recipe, auto_tile
from ..training.fp8_wire import FP8Dispatch, wire_bytes
from ..training.seeding import seed_everything
from ..training.tasks import make_task
from .experts import traffic

V3_LOSS_GAP = 0.0025
"""DeepSeek-V3's FP8 training loss relative to BF16's: within 0.25% (arXiv 2412.19437, §3.3 and appendix B.1),
validated on two smaller MoEs (about 16B and 230B parameters, about 1T tokens each), not on the 671B run itself."""
BASE = dict(world_size=2, global_batch=32, tensorboard=False, save_final=False)


def all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value an 8-bit float holds, sorted: its 256 bit patterns read as numbers."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return values[torch.isfinite(values)].unique()


def formats_table() -> pd.DataFrame:
    """One row per format: bits, max, smallest normal and subnormal, step after 1, worst rounding error (relative),
    dynamic range in factors of 2. FP8's rows are read from all 256 bit patterns (`measured_*`) beside torch.finfo."""
    rows = []
    for spec in FORMATS.values():
        v = all_values(spec.dtype)
        positive = v[v > 0]
        rows.append({"format": spec.name, "dtype": str(spec.dtype).removeprefix("torch."),
                     "exponent_bits": spec.exponent_bits, "mantissa_bits": spec.mantissa_bits, "max": spec.max,
                     "measured_max": v.max().item(), "smallest_normal": spec.smallest_normal,
                     "smallest_subnormal": spec.smallest_subnormal, "measured_smallest": positive.min().item(),
                     "step_after_1": spec.step_at_one, "measured_step_after_1": (v[v > 1].min() - 1).item(),
                     "rounding_error": spec.relative_error, "range_log2": spec.dynamic_range,
                     "finite_values": len(v)})
    bf = torch.finfo(torch.bfloat16)
    rows.append({"format": "bf16", "dtype": "bfloat16", "exponent_bits": 8, "mantissa_bits": 7, "max": bf.max,
                 "smallest_normal": bf.smallest_normal, "smallest_subnormal": bf.smallest_normal * 2**-7,
                 "step_after_1": bf.eps, "rounding_error": bf.eps / 2,
                 "range_log2": np.log2(bf.max / (bf.smallest_normal * 2**-7))})
    return pd.DataFrame(rows).set_index("format")


def roundtrip(x: torch.Tensor, tile: int = 128) -> pd.DataFrame:
    """x quantised and dequantised per format x granularity: relative error, the worst element's error as a share
    of its bound (<= 1 when the bound holds), scales used and bytes per value with them (1 + 4 / group size)."""
    rows = []
    for fmt in FORMATS:
        for granularity in ("tensor", "tile", "block") if x.dim() == 2 else ("tensor", "tile"):
            q = quantise(x, fmt, granularity, tile)
            x_hat = q.dequantise()
            worst = ((x - x_hat).abs() / error_bound(q, fmt, x)).max().item()
            rows.append({"format": fmt, "granularity": granularity, "error": relative_error(x, x_hat),
                         "worst_vs_bound": worst, "scales": q.scale_count(),
                         "bytes_per_value": 1 + 4 * q.scale_count() / x.numel()})
    return pd.DataFrame(rows).set_index(["format", "granularity"])


def outlier_case(rows: int = 256, width: int = 256, outlier: float = 1e5, tile: int = 128,
                 seed: int = 0) -> pd.DataFrame:
    """Activations [rows, width] ~ N(0, 1) with one outlier at [0, 0], and a weight [width, width]: E4M3 error of
    the other rows per scaling, for the activations alone and for the matmul's output (weight blocks tile x tile),
    the share of their values flushed to zero, and the error of the other values in the outlier's own row."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, width, generator=g), torch.randn(width, width, generator=g) / width ** 0.5
    x[0, 0] = outlier
    exact, out = x @ w.t(), []
    for scaling in ("tensor", "tile"):
        recipe = Recipe(scaling, tile)
        x_hat, y = recipe.activation(x), FP8Matmul.apply(x, w, recipe)
        flushed = ((x_hat[1:] == 0) & (x[1:] != 0)).float().mean().item()
        out.append({"scaling": scaling, "tile": tile if scaling == "tile" else None,
                    "activation_error": relative_error(x[1:], x_hat[1:]), "flushed_to_zero": flushed,
                    "matmul_error": relative_error(exact[1:], y[1:]),
                    "same_row_error": relative_error(x[0, 1:], x_hat[0, 1:])})
    return pd.DataFrame(out).set_index("scaling")


def scaled_mm_check(m: int = 64, k: int = 128, n: int = 32, seed: int = 0) -> dict[str, float]:
    """The simulated FP8 GEMM against torch._scaled_mm (torch's FP8 GEMM, which runs on CPU with per-tensor and
    per-row scales), on the same FP8 values and scales: the largest difference relative to the largest output."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    out = {}
    for name, kind in (("tensor", "tensor"), ("row", "tile")):
        qa, qb = quantise(a, "e4m3", kind, k), quantise(b, "e4m3", kind, k)
        rowwise = kind == "tile"  # one scale per row of a, per column of b.T: shaped as _scaled_mm reads them
        sa, sb = (qa.scale.reshape(-1, 1), qb.scale.reshape(1, -1)) if rowwise else (qa.scale, qb.scale)
        fa, fb = qa.data.reshape(m, k), qb.data.reshape(n, k)
        torch_fp8 = torch._scaled_mm(fa, fb.t(), scale_a=sa.float(), scale_b=sb.float(), out_dtype=torch.float32)
        simulated = qa.dequantise() @ qb.dequantise().t()
        out[f"{name}_difference"] = ((torch_fp8 - simulated).abs().max() / simulated.abs().max()).item()
    return out


TORCHAO_RECIPES = {"tensorwise": {"fp8_scaling": "tensor", "fp8_grad_format": "e5m2"},
                   "rowwise": {"fp8_scaling": "row", "fp8_grad_format": "e4m3"}}
"""torchao's two recipes that run on a CPU, as RunConfig fields: its tensorwise recipe casts gradients to E5M2, its
rowwise recipe everything to E4M3 with power-of-two scales (torchao.float8.Float8LinearConfig.from_recipe_name)."""


def torchao_check(steps: int = 8, lr: float = 1e-2, seed: int = 0) -> pd.DataFrame:
    """In this process, per recipe of TORCHAO_RECIPES: the tiny DeepSeek-V3 trained `steps` AdamW steps twice from
    the same weights on the same batches, its nn.Linear layers once as torchao's Float8Linear (fp8_engine "torchao")
    and once in labkit's simulation of the same recipe (the routed experts in labkit's simulation both times).
    One row per recipe: the layers that became torchao's Float8Linear (counted on the model), the torch._scaled_mm
    calls one step made in each (counted by torch.profiler), each run's first and last loss, and the largest
    relative gap between the two runs' losses (every step) and gradients (every parameter, first step).
    attrs["losses"]: {recipe: {engine: [loss per step]}};
    attrs["layers"]: the converted layers' names and classes. Raises ModuleNotFoundError without torchao."""
    import torchao  # noqa: F401 - the fp8 extra; fails here, by name, when it is missing

    rows, losses, layers = [], {}, {}
    for recipe, fields in TORCHAO_RECIPES.items():
        runs = {engine: _train_here(lesson_config(task="tinymoe", precision="fp8", fp8_engine=engine, seed=seed,
                                                  **fields), steps, lr) for engine in ("labkit", "torchao")}
        ours, theirs = runs["labkit"], runs["torchao"]
        losses[recipe] = {engine: run["losses"] for engine, run in runs.items()}
        layers = theirs["classes"]
        # counted on the trained model, not from the names labkit asked torchao to convert
        converted = sum(1 for kind in theirs["classes"].values() if kind == "Float8Linear")
        rows.append({"recipe": recipe, **fields, "torchao_layers": converted,
                     "scaled_mm_per_step": theirs["scaled_mm"], "labkit_scaled_mm": ours["scaled_mm"],
                     "loss_first": theirs["losses"][0], "loss_last": theirs["losses"][-1],
                     "loss_gap": max(abs(a - b) / abs(b) for a, b in zip(theirs["losses"], ours["losses"])),
                     "grad_gap": max(relative_error(ours["grads"][n], g) for n, g in theirs["grads"].items())})
    table = pd.DataFrame(rows).set_index("recipe")
    table.attrs.update(losses=losses, layers=layers, steps=steps)
    return table


def _train_here(config: RunConfig, steps: int, lr: float) -> dict[str, Any]:
    """config's model switched as the loop switches it, trained `steps` AdamW steps in this process on the task's
    batches; the first step under torch.profiler (its aten::_scaled_mm calls counted) and its gradients kept."""
    seed_everything(config.seed)
    task = make_task(config, 1)
    model = task.build_model()
    done = apply_fp8(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    out: dict[str, Any] = {"losses": [], "torchao": done["torchao"],
                           "classes": {n: type(m).__name__ for n, m in model.named_modules() if is_fp8(m)}}
    for step in range(steps):
        counting = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with counting if step == 0 else contextlib.nullcontext() as prof:
            loss, _ = task.loss(model, *task.batch(step, 0, 0))
            loss.backward()
        if step == 0:
            out["scaled_mm"] = sum(1 for e in prof.events() if e.name == "aten::_scaled_mm")
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
    return out


def layers_table(config: RunConfig) -> pd.DataFrame:
    """config's model switched to FP8 as labkit's loop switches it: every layer with weights, its class after the
    switch, and whether its matmul runs in FP8 or stays in fp32 (the head, the routers, norms, embeddings)."""
    model = make_task(config, 1).build_model()
    switched = apply_fp8(model, config.replace(precision="fp8"))["layers"]
    rows = [{"layer": name, "class": type(m).__name__, "fp8": name in switched}
            for name, m in model.named_modules() if name in switched or name in kept(model)]
    return pd.DataFrame(rows).set_index("layer")


def model_tensors(config: RunConfig, tile: int | None = None) -> pd.DataFrame:
    """One fp32 forward and backward of config's model on one batch; each tensor an FP8 layer would quantise (its
    input activations, its weight, the gradient arriving at its output), quantised per format x scaling. Per row:
    the mean relative error over layers, the worst layer's, the share of non-zero values flushed to zero, and the
    largest |value| / root-mean-square of the activations (how outlier-heavy this model is)."""
    seed_everything(config.seed)  # the initial weights a run of this config starts from
    task = make_task(config, 1)
    model = task.build_model()
    layers = candidates(model)  # left in fp32: what they would quantise is measured, not what they did
    seen: dict[str, dict[str, torch.Tensor]] = {}
    hooks = [m.register_forward_hook(_save_input(seen, n)) for n, m in layers.items()]
    hooks += [m.register_full_backward_hook(_save_grad(seen, n)) for n, m in layers.items()]
    loss, _ = task.loss(model, *task.batch(0, 0, 0))
    loss.backward()
    for h in hooks:
        h.remove()
    for name, module in layers.items():
        seen.setdefault(name, {})["weight"] = _weight(module)
    return _tensor_table(seen, tile or auto_tile(int(model.config.hidden_size)))


def _save_input(seen: dict, name: str) -> Any:
    def hook(module: Any, args: tuple, output: Any) -> None:
        seen.setdefault(name, {})["activation"] = args[0].detach().reshape(-1, args[0].shape[-1])
    return hook


def _save_grad(seen: dict, name: str) -> Any:
    def hook(module: Any, grad_in: tuple, grad_out: tuple) -> None:
        seen.setdefault(name, {})["gradient"] = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1])
    return hook


def _weight(module: Any) -> torch.Tensor:
    w = module.gate_up_proj[0] if hasattr(module, "gate_up_proj") else module.weight
    return (w.t() if type(module).__name__ == "Conv1D" else w).detach()


def _tensor_table(seen: dict, tile: int) -> pd.DataFrame:
    rows = []
    for kind in ("activation", "weight", "gradient"):
        for fmt in FORMATS:
            for scaling in ("tensor", "tile"):
                grain = "block" if kind == "weight" and scaling == "tile" else scaling
                errors, flushed = [], []
                for tensors in seen.values():
                    x = tensors.get(kind)
                    if x is None or not x.numel():
                        continue
                    x_hat = fake_quantise(x, fmt, grain, tile)
                    errors.append(relative_error(x, x_hat))
                    flushed.append(((x_hat == 0) & (x != 0)).float().mean().item())
                rows.append({"tensor": kind, "format": fmt, "scaling": scaling, "mean_error": np.mean(errors),
                             "worst_error": np.max(errors), "flushed_to_zero": np.mean(flushed)})
    table = pd.DataFrame(rows).set_index(["tensor", "format", "scaling"])
    peaks = [(x.abs().max() / x.pow(2).mean().sqrt()).item() for t in seen.values() for k, x in t.items()
             if k == "activation" and x.numel()]
    table.attrs.update(layers=len(seen), tile=tile, activation_peak_over_rms=max(peaks))
    return table


def lesson_config(**fields: Any) -> RunConfig:
    """The lesson's run: tinylm on 2 ranks, 32 sentences per step, unless fields say otherwise."""
    return RunConfig(**{**BASE, **fields})


def train(cases: dict[str, dict[str, Any]], *, steps: int, runs_root: Any = None, **common: Any) -> dict[str, Run]:
    """One run per case ({name: RunConfig fields}), in order:  train({"fp8": {"precision": "fp8"}}, steps=20)."""
    return {name: launch(lesson_config(steps=steps, name=name, **{**common, **fields}), echo=False,
                         runs_root=runs_root) for name, fields in cases.items()}


def loss_table(runs: dict[str, Run], last: int = 5) -> pd.DataFrame:
    """Per run: the loss (mean of the last `last` steps, over ranks), its gap to the "fp32" run and to the "bf16"
    run (relative), and V3's reported gap to BF16, for scale."""
    final = {name: run.steps()["loss"].iloc[-last:].mean() for name, run in runs.items()}
    table = pd.DataFrame({"loss": final})
    for ref in ("fp32", "bf16"):
        if ref in final:
            table[f"gap_to_{ref}"] = (table["loss"] - final[ref]) / final[ref]
    table["v3_reported_gap"] = V3_LOSS_GAP
    return table


def dispatch_check(world_size: int = 2, tokens: int = 64, width: int = 32, tile: int = 8,
                   runs_root: Any = None) -> dict:
    """On `world_size` ranks: one expert-parallel layer (4 experts per rank, top-2) run forward and backward with
    its dispatch in fp32 and in FP8, collectives counted at the dispatcher. Returns rank 0's measurements, among
    them "dispatch_vs_bound": the largest dispatched value's error over what E4M3 rounding may cost it (<= 1)."""
    from functools import partial
    run = launch(partial(_dispatch_rank, tokens=tokens, width=width, tile=tile), world_size=world_size, echo=False,
                 progress=False, runs_root=runs_root, name="fp8 dispatch")
    return run.result(0)


def _dispatch_rank(ctx: Any, tokens: int, width: int, tile: int) -> dict:
    import torch.distributed as dist
    from ..training.parallel.dispatchcount import DispatchCounter
    from ..training.parallel.experts import Expert, ExpertBank, ExpertParallel
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    local, experts = 4, 4 * ctx.world_size
    bank = ExpertBank([Expert(torch.randn(2 * width, width, generator=g) / width ** 0.5,
                              torch.randn(width, width, generator=g) / width ** 0.5, torch.nn.functional.silu)
                       for _ in range(local)], first=ctx.rank * local)
    layer = ExpertParallel(bank, experts, group=dist.group.WORLD)
    hidden = torch.randn(tokens, width, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    out: dict[str, Any] = {"rows_out": tokens * 2, "width": width, "tile": tile}
    for name, wire in (("fp32", None), ("fp8", FP8Dispatch(tile))):
        layer.wire, arrived = wire, []
        layer.on_arrival = lambda rows, arrived=arrived: arrived.append(rows.clone())   # as the experts get them
        x = hidden.clone().requires_grad_(True)
        with DispatchCounter() as counter:
            y = layer(x, index, weights)
            y.square().sum().backward()
        out[name] = {"bytes": counter.take_kinds().get("all_to_all"), "output": y.detach(), "grad": x.grad,
                     "arrived": torch.cat(arrived)}
    layer.on_arrival = None
    out["output_error"] = relative_error(out["fp32"]["output"], out["fp8"]["output"])
    out["grad_error"] = relative_error(out["fp32"]["grad"], out["fp8"]["grad"])
    # each dispatched value against the most E4M3 with its row's tile scale may move it (error_bound): the same
    # routing both times, so the rows arrive in the same order
    exact, travelled = out["fp32"].pop("arrived"), out["fp8"].pop("arrived")
    bound = error_bound(quantise(exact, "e4m3", "tile", tile), "e4m3", exact)
    out["dispatch_vs_bound"] = float(((travelled - exact).abs() / bound).max()) if exact.numel() else 0.0
    out["rows_in"] = layer.take_stats()["rows_in"] / 2
    return out


def wire_traffic(run: Run) -> pd.DataFrame:
    """experts.traffic(run) (all_to_all bytes counted per rank and step, and the formula from the routed rows),
    with the formula's forward dispatch at FP8's bytes when the run dispatched in FP8 (fp8_wire.wire_bytes)."""
    df = traffic(run)
    cfg = run.config
    if cfg.fp8_dispatch:
        width = make_task(cfg, 1).build_model().config.hidden_size
        tile = cfg.fp8_tile or auto_tile(width)
        df["formula"] += [wire_bytes(int(r), width, tile) - int(r) * width * 4 for r in df.ep_rows_out]
    return df


def dispatch_bytes_per_value(tile: int, model_bytes: int = 4) -> dict[str, float]:
    """Bytes per value a dispatch carries: the model's precision, and FP8 with a 4-byte scale per tile (a formula)."""
    return {"model_precision": model_bytes, "fp8": 1 + 4 / tile, "ratio": (1 + 4 / tile) / model_bytes}


__all__ = ["FORMATS", "V3_LOSS_GAP", "all_values", "formats_table", "roundtrip", "outlier_case",
           "scaled_mm_check", "model_tensors", "lesson_config", "train", "loss_table", "dispatch_check",
           "wire_traffic", "dispatch_bytes_per_value", "auto_tile", "layers_table",
           "TORCHAO_RECIPES", "torchao_available", "torchao_check"]
