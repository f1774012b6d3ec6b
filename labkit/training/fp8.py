"""FP8 numbers: the two formats, and quantising a tensor to them with one scale per tensor, per tile or per block.

    FORMATS["e4m3"].max, FORMATS["e4m3"].mantissa_bits      # 448.0, 3 (torch.float8_e4m3fn)
    q = quantise(x, "e4m3", "tile", tile=16)                 # x [..., K]: one scale per 1 x 16 tile along K
    w = quantise(weight, "e4m3", "block", tile=16)           # weight [N, K]: one scale per 16 x 16 block
    x_hat = q.dequantise()                                   # back to fp32, with the rounding FP8 did
    fake_quantise(x, "e5m2", "tensor")                       # the two steps at once: what a simulated GEMM reads

An FP8 value is sign, exponent and mantissa in 8 bits. E4M3 (4 exponent bits, 3 mantissa bits; torch's
float8_e4m3fn, "fn": finite, no infinities) reaches 448 with steps of 1/8 between 1 and 2; E5M2 (5 and 2) reaches
57344 with steps of 1/4. Neither holds a typical activation or gradient as it is, so each group of values is divided
by a scale first, chosen here from the group's largest magnitude (amax) so that it lands on the format's max: scale =
amax / max ("current scaling", as DeepSeek-V3 does; older recipes guessed the scale from past steps' amax). The
scales stay in fp32, next to the FP8 values.

Rounding: a value whose scaled magnitude is a normal FP8 number is off by at most half a step, 2**-(mantissa_bits
+ 1) of itself (E4M3: 1/16, E5M2: 1/8); below the smallest normal number the steps stop shrinking, so the error is at
most half a step there: 2**-(mantissa_bits + 1) x smallest_normal, times the scale. `error_bound` says exactly that.

Granularity (DeepSeek-V3 §3.3): "tensor" shares one scale over the whole tensor, so one outlier sets it and every
other value is squeezed into the few smallest steps (or under them, to zero). "tile" gives each 1 x t run of
consecutive values along the last dimension (the inner dimension a matmul sums over) its own scale; "block" gives
each t x t block of a matrix one (weights; V3 uses t = 128). A dimension that t does not divide ends in a shorter tile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GRANULARITIES = ("tensor", "tile", "block")


@dataclass(frozen=True)
class Format:
    """One FP8 format: its torch dtype and the numbers that decide what it can hold."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int

    @property
    def max(self) -> float:
        return torch.finfo(self.dtype).max

    @property
    def smallest_normal(self) -> float:
        return torch.finfo(self.dtype).smallest_normal

    @property
    def smallest_subnormal(self) -> float:
        return self.smallest_normal * 2.0 ** -self.mantissa_bits

    @property
    def step_at_one(self) -> float:
        """The gap between 1 and the next number (torch.finfo's eps): 2**-mantissa_bits."""
        return torch.finfo(self.dtype).eps

    @property
    def relative_error(self) -> float:
        """The most a normal number is off after rounding, as a share of itself: half a step."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def dynamic_range(self) -> float:
        """max / smallest subnormal: how many factors of two one scale can cover (log2 of it)."""
        return math.log2(self.max / self.smallest_subnormal)


FORMATS = {"e4m3": Format("e4m3", torch.float8_e4m3fn, 4, 3), "e5m2": Format("e5m2", torch.float8_e5m2, 5, 2)}


def fp8_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"FP8 format {name!r}: must be one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass
class Quantised:
    """FP8 values and their fp32 scales. `data` is [*groups, t] (tile) or [N/t, t, K/t, t] (block), padded;
    `scale` broadcasts against it; `shape` is the original tensor's."""

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    granularity: str

    def dequantise(self) -> torch.Tensor:
        """The fp32 tensor these FP8 values and scales stand for, in the original shape."""
        full = self.data.float() * self.scale
        if self.granularity == "tensor":
            return full.reshape(self.shape)
        if self.granularity == "tile":
            return full.flatten(-2)[..., :self.shape[-1]]
        rows, cols = self.shape
        return full.reshape(full.shape[0] * full.shape[1], -1)[:rows, :cols]

    def scale_count(self) -> int:
        return self.scale.numel()


def quantise(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor", tile: int = 128,
             power_of_two: bool = False) -> Quantised:
    """x in FP8 with scales: one per tensor, per 1 x tile run along the last dimension, or per tile x tile block of a
    2-D tensor (see the module docstring). power_of_two: each multiplier (max / amax) rounded down to a power of two,
    so each scale up to one, as torchao's rowwise recipe does (scaling by it is then exact)."""
    spec = fp8_format(fmt)
    x = x.detach().float()
    if granularity == "tensor":
        grouped = x
    elif granularity == "tile":
        grouped = _padded(x, -1, tile).unflatten(-1, (-1, tile))
    elif granularity == "block":
        if x.dim() != 2:
            raise ValueError(f"block scaling is for 2-D weights; got shape {tuple(x.shape)}")
        padded = _padded(_padded(x, 0, tile), 1, tile)
        grouped = padded.reshape(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile)
    else:
        raise ValueError(f"granularity {granularity!r}: must be one of {', '.join(GRANULARITIES)}")
    multiplier = _multiplier(grouped, granularity, spec.max, power_of_two)
    data = (grouped * multiplier).clamp(-spec.max, spec.max).to(spec.dtype)  # clamp: the product may round past max
    return Quantised(data, multiplier.reciprocal(), x.shape, granularity)  # the scale: amax / max


def fake_quantise(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor", tile: int = 128,
                  power_of_two: bool = False) -> torch.Tensor:
    """dequantise(quantise(x)) in x's dtype: x with FP8's rounding, what a GEMM on the FP8 values effectively reads."""
    return quantise(x, fmt, granularity, tile, power_of_two).dequantise().to(x.dtype)


def error_bound(q: Quantised, fmt: str, x: torch.Tensor) -> torch.Tensor:
    """Per element of x, the most rounding to `fmt` with q's scales may move it: half a step of the FP8 number it
    lands on, 2**-(m+1) x max(|x|, smallest_normal x scale) for m mantissa bits."""
    spec = fp8_format(fmt)
    scale = Quantised(torch.ones_like(q.data, dtype=torch.float32), q.scale, q.shape, q.granularity).dequantise()
    return spec.relative_error * torch.maximum(x.detach().abs().float(), spec.smallest_normal * scale)


def _multiplier(grouped: torch.Tensor, granularity: str, fmt_max: float, power_of_two: bool = False) -> torch.Tensor:
    """What each group is multiplied by before the cast: max / amax, computed as torchao computes it (in float64, then
    float32), so that labkit's FP8 values equal torchao's bit for bit; rounded down to a power of two if asked."""
    if granularity == "tensor":
        amax = grouped.abs().amax() if grouped.numel() else grouped.new_zeros(())  # an expert given no rows
    elif granularity == "tile":
        amax = grouped.abs().amax(-1, keepdim=True)
    else:
        amax = grouped.abs().amax(dim=(1, 3), keepdim=True)
    multiplier = (fmt_max / amax.double().clamp(min=1e-12)).float()
    if power_of_two:
        multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    # an all-zero group keeps multiplier 1 (any would do; max / 0 is infinite)
    return torch.where(amax > 0, multiplier, torch.ones_like(multiplier))


def _padded(x: torch.Tensor, dim: int, tile: int) -> torch.Tensor:
    """x with zeros appended along `dim` up to a multiple of tile (zeros never raise a group's amax)."""
    short = -x.shape[dim] % tile
    if not short:
        return x
    pad = list(x.shape)
    pad[dim] = short
    return torch.cat([x, x.new_zeros(pad)], dim=dim)


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """||x - x_hat|| / ||x||, the quantisation error of a tensor (0 for an all-zero x)."""
    x, x_hat = x.detach().float(), x_hat.detach().float()
    norm = x.norm()
    return float((x - x_hat).norm() / norm) if norm > 0 else 0.0
