"""Expert-parallel dispatch with FP8 payloads, as DeepSeek-V3 dispatches: 1 byte per value plus a scale per tile.

    layer.wire = FP8Dispatch(tile=8)        # on an ExpertParallel layer (parallel/experts.py): its forward dispatch
    arrived = FP8Dispatch(8)(rows, out_splits, in_splits, group)   # the same all_to_all, FP8 on the wire
    wire_bytes(rows=100, width=32, tile=8)  # 100 * 32 * 1 + 100 * 4 * 4: what this rank hands over

Forward: the rows (tokens, [R, H]) are quantised to E4M3 with one fp32 scale per 1 x tile run of each row (so a
token's scale is its own, wherever it goes), and two all_to_all_single calls carry them: the FP8 values as their
uint8 view (gloo's all_to_all rejects float8 tensors with "Invalid scalar type"; the bytes are the same), and the
scales. The receiver dequantises to fp32 before its experts run. Backward: the gradients travel back in the
model's precision (V3 too keeps the combine and its gradients out of FP8); the quantisation is passed straight
through (its gradient taken as 1, as every FP8 recipe does).

The bytes are counted where every collective is, at the dispatcher (parallel/dispatchcount.py) or at
torch.distributed (commhooks.py): both read the element size of the uint8 tensor, 1 byte.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .fp8 import quantise


def wire_bytes(rows: int, width: int, tile: int) -> int:
    """Bytes one FP8 dispatch of `rows` rows of `width` values hands over: 1 per value (a row padded to whole
    tiles when tile does not divide width), 4 per tile for its scale."""
    tiles = -(-width // tile)
    return rows * tiles * tile + rows * tiles * 4


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
                tile: int) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.dtype = (out_splits, in_splits), group, rows.dtype
        q = quantise(rows, "e4m3", "tile", tile)                       # data [R, H/t, t], scale [R, H/t, 1]
        data, scale = q.data.view(torch.uint8).flatten(1), q.scale.flatten(1)
        got = data.new_empty(sum(out_splits), data.shape[1])
        got_scale = scale.new_empty(sum(out_splits), scale.shape[1])
        dist.all_to_all_single(got, data.contiguous(), out_splits, in_splits, group=group)
        dist.all_to_all_single(got_scale, scale.contiguous(), out_splits, in_splits, group=group)
        values = got.view(torch.float8_e4m3fn).float().unflatten(1, (scale.shape[1], -1)) * got_scale[..., None]
        return values.flatten(1)[:, :rows.shape[1]].to(rows.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back.to(ctx.dtype), None, None, None, None


class FP8Dispatch:
    """The forward dispatch of ExpertParallel in FP8 (see the module docstring); callable as its `wire`."""

    def __init__(self, tile: int):
        self.tile = tile

    def __call__(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        return _Dispatch.apply(rows, out_splits, in_splits, group, self.tile)

    def __repr__(self) -> str:
        return f"FP8Dispatch(tile={self.tile})"
