"""A linear layer's three matmuls in simulated FP8, forward and backward, as DeepSeek-V3 runs them (§3.3).

    recipe = Recipe(scaling="tile", tile=16, grad_format="e4m3")   # or Recipe.from_config(config, width=64)
    y = fp8_linear(x, weight, bias, recipe)                         # x [..., K], weight [N, K]: like F.linear

Each matmul's two operands are quantised (training/fp8.py), multiplied in fp32 and the result left in fp32:
    forward  y  = x @ W.T        x: E4M3, 1 x t tiles along K        W: E4M3, t x t blocks
    backward dx = dy @ W         dy: grad_format, 1 x t tiles along N  W: the same blocks
             dW = dy.T @ x       dy, x: 1 x t tiles along the tokens (the dimension this product sums over)
With scaling "tensor" every operand gets one scale instead. With scaling "row" (torchao's rowwise recipe) each
operand gets one scale per row along the dimension its product sums over, rounded to a power of two: x and W per
row along K forward, dy per row along N and W per column (along N) for dx, dy and x along the tokens for dW; and
each product is rounded to bf16, as torchao writes a rowwise GEMM's output (torch._scaled_mm offers no fp32 output
for row scales on GPUs, so torchao asks for bf16 everywhere; measured: without it, 0.0017 relative apart).
The gradient's format is the recipe's: "e4m3" as V3
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

SCALINGS = ("tensor", "row", "tile")
GRAD_FORMATS = ("e4m3", "e5m2")


def auto_tile(width: int) -> int:
    """The tile size for a model `width` wide: width / 4, at least 8 (see RunConfig.fp8_tile for why)."""
    return max(8, width // 4)


@dataclass(frozen=True)
class Recipe:
    """How the matmuls are quantised: scaling "tensor" | "row" | "tile", the tile size t ("tile" only), the
    gradients' format; "row" rounds its scales to powers of two, as torchao's rowwise recipe does."""

    scaling: str = "tile"
    tile: int = 128
    grad_format: str = "e4m3"

    @property
    def power_of_two(self) -> bool:
        return self.scaling == "row"

    @classmethod
    def from_config(cls, config: RunConfig, width: int) -> "Recipe":
        """RunConfig's fp8_scaling, fp8_tile (0: auto_tile(width)) and fp8_grad_format."""
        return cls(config.fp8_scaling, config.fp8_tile or auto_tile(width), config.fp8_grad_format)

    def activation(self, x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
        """x [M, K] as the matmul reads it: 1 x t tiles along K (the last dimension), one scale per row, or one."""
        if self.scaling == "tensor":
            return fake_quantise(x, fmt, "tensor")
        tile = x.shape[-1] if self.scaling == "row" else self.tile
        # max(.., 1): an expert given no tokens makes dy.t() of width 0, whose "row" is empty
        return fake_quantise(x, fmt, "tile", max(tile, 1), self.power_of_two)

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """w [N, K] as the forward matmul reads it: t x t blocks, one scale per row (along K), or one."""
        if self.scaling == "row":
            return self.activation(w)
        return fake_quantise(w, "e4m3", "block" if self.scaling == "tile" else "tensor", self.tile)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b of two fake-quantised operands, summed in fp32; rounded to bf16 under "row" (torchao's output)."""
        out = a @ b
        return out.to(torch.bfloat16).float() if self.scaling == "row" else out

    def weight_for_grad_input(self, w: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
        """w [N, K] as dx = dy @ w reads it, which sums over N: per column under "row" (a cast of its own, as
        torchao's); the forward's blocks or tensor scale otherwise (one square block serves both directions)."""
        return self.activation(w.t()).t() if self.scaling == "row" else forward


class FP8Matmul(torch.autograd.Function):
    """y = x @ w.T with both operands in FP8 (forward) and dy in recipe.grad_format (backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        wq = recipe.weight(w)
        ctx.save_for_backward(x, w, wq)
        ctx.recipe = recipe
        return recipe.product(recipe.activation(x), wq.t())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w, wq = ctx.saved_tensors
        recipe = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = recipe.product(recipe.activation(dy, recipe.grad_format), recipe.weight_for_grad_input(w, wq))
        if ctx.needs_input_grad[1]:  # wgrad sums over tokens: tiles run along them (the transposed operands)
            dw = recipe.product(recipe.activation(dy.t(), recipe.grad_format), recipe.activation(x.t()).t())
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe) -> torch.Tensor:
    """F.linear(x, weight, bias) with the matmul in simulated FP8 (forward and backward), in fp32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    y = FP8Matmul.apply(flat, weight.float(), recipe)
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
