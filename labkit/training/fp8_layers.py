"""Which layers of the tiny models run their matmuls in FP8, and switching them over in place.

    names = to_fp8(model, Recipe(scaling="tile", tile=16))   # the layers now in FP8, by name
    names = to_torchao(model, Recipe(scaling="row"))         # the nn.Linear ones as torchao's Float8Linear instead
    apply_fp8(model, config)                                 # what labkit's loop does (RunConfig.precision="fp8",
                                                             # RunConfig.fp8_engine, RunConfig.fp8_dispatch)

What the tiny models compute, and what V3's recipe puts in FP8:
    tinylm (transformers' GPT-2)  8 x Conv1D (c_attn, attn.c_proj, c_fc, mlp.c_proj per block): x @ W + b   FP8
                                  the LM head, an nn.Linear tied to the embeddings                            kept
    tinymoe (DeepSeek-V3)         attention's and the shared expert's nn.Linear layers                        FP8
                                  routed experts: F.linear on slices of 3-D fused parameters                  FP8
                                  (or, under expert parallelism, labkit's Expert modules: parallel/experts.py)
                                  the router (fp32 F.linear), the LM head                                     kept
Embeddings, normalisations and attention's softmax products stay in fp32 in both (V3 keeps them in BF16/FP32).

transformers 5.24 runs DeepSeek-V3's fused experts through `grouped_mm` by default, one kernel for all experts; the
FP8 version loops over the experts that got tokens (transformers' "eager" path) so each expert's weights get their
own blocks of scales, as V3's do. Layers are switched by changing their class to an FP8 subclass: the parameters,
their names and the state dict stay exactly as they were (checkpoints, DDP's buckets and the optimizer see no
difference), and print(model) shows which layers are FP8.

fp8_engine "torchao" hands the nn.Linear candidates to torchao instead (torchao.float8.convert_to_float8_training:
its Float8Linear, whose matmuls are torch._scaled_mm calls on FP8 tensors: FP8 GEMMs on a GPU, emulated in fp32 by
torch on a CPU without AMX). torchao's tensorwise and rowwise recipes are labkit's "tensor" and "row" scalings; the
other candidates (GPT-2's Conv1D, the routed experts) are not nn.Linear and keep labkit's simulation of the same recipe.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
from transformers.pytorch_utils import Conv1D

from .fp8 import FORMATS
from .fp8_linear import Recipe, fp8_linear
from .fp8_wire import FP8Dispatch
from .parallel.experts import Expert, expert_parallel_modules
from ..config import RunConfig


class FP8Layer:
    """Mixin of the FP8 layer classes: the recipe they quantise with (set by to_fp8), shown in repr."""

    fp8_recipe: Recipe

    def extra_repr(self) -> str:
        r = self.fp8_recipe
        return f"{super().extra_repr()}, fp8={r.scaling} t={r.tile} grad={r.grad_format}".lstrip(", ")


class FP8Linear(FP8Layer, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_recipe)


class FP8Conv1D(FP8Layer, Conv1D):
    """GPT-2's Conv1D keeps its weight as [in, out] (x @ W + b): the same matmul with W transposed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight.t(), self.bias, self.fp8_recipe)


class FP8Expert(FP8Layer, Expert):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fp8_linear(x, self.gate_up_proj, None, self.fp8_recipe).chunk(2, dim=-1)
        return fp8_linear(self.act(gate) * up, self.down_proj, None, self.fp8_recipe)


class FP8Experts(FP8Layer, DeepseekV3Experts):
    """transformers' fused experts, each expert that got tokens computed on its own weight slices in FP8."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        k, chosen, weights = top_k_index.shape[-1], top_k_index.reshape(-1), top_k_weights.reshape(-1)
        for e in chosen.unique().tolist():
            if e >= self.num_experts:  # transformers' marker of an expert held elsewhere
                continue
            where = torch.nonzero(chosen == e).squeeze(-1)
            gate, up = fp8_linear(hidden[where // k], self.gate_up_proj[e], None, self.fp8_recipe).chunk(2, dim=-1)
            done = fp8_linear(self.act_fn(gate) * up, self.down_proj[e], None, self.fp8_recipe)
            out.index_add_(0, where // k, done * weights[where, None].to(done.dtype))
        return out


SWAPS: dict[type, type] = {nn.Linear: FP8Linear, Conv1D: FP8Conv1D, Expert: FP8Expert,
                           DeepseekV3Experts: FP8Experts}
"""Each layer class computed in FP8, and its FP8 subclass (exact class matches: subclasses are left alone)."""


def candidates(model: nn.Module) -> dict[str, nn.Module]:
    """The layers to_fp8 switches, by name: every layer of a class SWAPS names, but the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: m for name, m in model.named_modules() if type(m) in SWAPS and m is not head}


def to_fp8(model: nn.Module, recipe: Recipe) -> list[str]:
    """Switch the candidates to FP8 in place (their class becomes the FP8 subclass); returns their names."""
    switched = candidates(model)
    for module in switched.values():
        module.__class__ = SWAPS[type(module)]
        module.fp8_recipe = recipe
    return list(switched)


def to_torchao(model: nn.Module, recipe: Recipe) -> list[str]:
    """The nn.Linear candidates as torchao's Float8Linear, in place, with recipe's scaling ("tensor": torchao's
    tensorwise; "row": rowwise, scales rounded to powers of two) and gradient format; returns their names."""
    from torchao.float8 import convert_to_float8_training  # the fp8 extra: RunConfig checks it is installed

    names = {name for name, m in candidates(model).items() if type(m) is nn.Linear}
    convert_to_float8_training(model, config=torchao_config(recipe), module_filter_fn=lambda _, fqn: fqn in names)
    return sorted(names)


def torchao_config(recipe: Recipe) -> Any:
    """torchao's Float8LinearConfig for recipe: "tensor" -> tensorwise, "row" -> rowwise (axiswise casts, power-of-two
    scales), activations and weights in E4M3, gradients in recipe.grad_format."""
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity

    if recipe.scaling not in ("tensor", "row"):
        raise ValueError(f"torchao on this machine runs scaling 'tensor' or 'row', not {recipe.scaling!r} (its "
                         "blockwise recipe is a Triton prototype for GPUs)")
    grain = ScalingGranularity.TENSORWISE if recipe.scaling == "tensor" else ScalingGranularity.AXISWISE

    def cast(fmt: str) -> Any:
        return CastConfig(scaling_granularity=grain, target_dtype=FORMATS[fmt].dtype)

    return Float8LinearConfig(cast_config_input=cast("e4m3"), cast_config_weight=cast("e4m3"),
                              cast_config_grad_output=cast(recipe.grad_format),
                              round_scales_to_power_of_2=recipe.power_of_two)


def is_fp8(module: nn.Module) -> bool:
    """Whether module's matmuls run in FP8: one of labkit's FP8 layers, or torchao's Float8Linear."""
    return isinstance(module, FP8Layer) or type(module).__name__ == "Float8Linear"


def kept(model: nn.Module) -> list[str]:
    """Names of the layers with weights that stay in high precision (the head, routers, norms, embeddings)."""
    return [name for name, m in model.named_modules() if not is_fp8(m)
            and any(True for _ in m.parameters(recurse=False))]


def model_width(model: nn.Module) -> int:
    """The hidden width of a transformers model (GPT-2's n_embd, DeepSeek-V3's hidden_size)."""
    return int(model.config.hidden_size)


def apply_fp8(model: nn.Module, config: RunConfig) -> dict[str, Any]:
    """As config says: the matmuls in FP8 (precision "fp8") and the expert-parallel dispatch in FP8 (fp8_dispatch).
    Returns what was switched: {"layers": [...], "torchao": [...] (fp8_engine "torchao": the layers torchao took),
    "dispatch": number of MoE layers dispatching in FP8}."""
    done: dict[str, Any] = {"layers": [], "torchao": [], "dispatch": 0}
    if config.precision != "fp8" and not config.fp8_dispatch:
        return done
    recipe = Recipe.from_config(config, model_width(model))
    if config.precision == "fp8":
        if config.fp8_engine == "torchao":
            done["torchao"] = to_torchao(model, recipe)  # first: to_fp8 leaves torchao's layers (not exactly nn.Linear)
        done["layers"] = done["torchao"] + to_fp8(model, recipe)
    if config.fp8_dispatch:
        for layer in expert_parallel_modules(model):
            layer.wire = FP8Dispatch(recipe.tile)
            done["dispatch"] += 1
    return done
