"""A linear layer's three matmuls in simulated FP8, forward and backward, as DeepSeek-V3 runs them (§3.3).

    recipe = Recipe(scaling="tile", tile=16, grad_format="e4m3")   # or Recipe.from_config(config, width=64)
    y = fp8_linear(x, weight, bias, recipe)                         # x [..., K], weight [N, K]: like F.linear

Each matmul's two operands are quantised (training/fp8.py), multiplied in fp32 and the result left in fp32:
    forward  y  = x @ W.T        x: E4M3, 1 x t tiles along K        W: E4M3, t x t blocks
    backward dx = dy @ W         dy: grad_format, 1 x t tiles along N  W: the same blocks
             dW = dy.T @ x       dy, x: 1 x t tiles along the tokens (the dimension this product sums over)
With scaling "tensor" every operand gets one scale instead. The gradient's format is the recipe's: "e4m3" as V3
(fine-grained scales make E4M3's narrower range enough), or "e5m2", the older hybrid recipe's choice for gradients
(its wider range, for one scale per tensor). The bias and its gradient stay in fp32, as do the embeddings, the
normalisations, attention's own products, the router and the output head (V3 keeps them in higher precision).

This is a simulation, and honest about what it shows: FP8's rounding, exactly (a GEMM on FP8 inputs with fp32
accumulation computes the product of the dequantised values; torch._scaled_mm on the CPU gives the same numbers
per tensor, labkit.tricks.fp8 checks it). It says nothing of speed: on CPU the quantising is extra work, and no
tensor core is involved. What it does not reproduce: the limited-precision accumulation inside H800 tensor cores
that V3 works around by promoting partial sums to fp32 every 128 products.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .fp8 import fake_quantise
from ..config import RunConfig

SCALINGS = ("tensor", "tile")
GRAD_FORMATS = ("e4m3", "e5m2")


def auto_tile(width: int) -> int:
    """The tile size for a model `width` wide: width / 4, at least 8 (see RunConfig.fp8_tile for why)."""
    return max(8, width // 4)


@dataclass(frozen=True)
class Recipe:
    """How the matmuls are quantised: scaling "tensor" | "tile", the tile size t, the gradients' format."""

    scaling: str = "tile"
    tile: int = 128
    grad_format: str = "e4m3"

    @classmethod
    def from_config(cls, config: RunConfig, width: int) -> "Recipe":
        """RunConfig's fp8_scaling, fp8_tile (0: auto_tile(width)) and fp8_grad_format."""
        return cls(config.fp8_scaling, config.fp8_tile or auto_tile(width), config.fp8_grad_format)

    def activation(self, x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
        """x [M, K] as the matmul reads it: 1 x t tiles along K (the last dimension), or one scale."""
        return fake_quantise(x, fmt, "tile" if self.scaling == "tile" else "tensor", self.tile)

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, K] as the matmul reads it: t x t blocks, or one scale."""
        return fake_quantise(w, "e4m3", "block" if self.scaling == "tile" else "tensor", self.tile)


class FP8Matmul(torch.autograd.Function):
    """y = x @ w.T with both operands in FP8 (forward) and dy in recipe.grad_format (backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        wq = recipe.weight(w)
        ctx.save_for_backward(x, wq)
        ctx.recipe = recipe
        return recipe.activation(x) @ wq.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, wq = ctx.saved_tensors
        recipe = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = recipe.activation(dy, recipe.grad_format) @ wq                   # dgrad: sums over N
        if ctx.needs_input_grad[1]:  # wgrad sums over tokens: tiles run along them (the transposed operands)
            dw = recipe.activation(dy.t(), recipe.grad_format) @ recipe.activation(x.t()).t()
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe) -> torch.Tensor:
    """F.linear(x, weight, bias) with the matmul in simulated FP8 (forward and backward), in fp32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    y = FP8Matmul.apply(flat, weight.float(), recipe)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
