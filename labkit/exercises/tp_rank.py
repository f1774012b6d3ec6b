"""Inside a rank: drive a learner's column- and row-parallel layers through the residual block the checker runs
(checks_tp.py judges what this returns).

    drive_tp(ctx, MyColumnParallelLinear, MyRowParallelLinear)   # in each rank: its outputs, gradients, the
                                                                 # collectives and the learner's function of each

The steps run in order (kept slices, the column layer's forward, the row layer's forward, backward), and all ranks
stop after the first step that is wrong on any rank, so that a failure is blamed on the function that made it.
"""
from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..training.parallel.dispatchcount import DispatchCounter, _kind
from .learner import is_learners, learner_part

TOLERANCE = 1e-5
SIZES = (8, 16, 8)    # input, hidden (split over the ranks), output features
BATCH = 4


def _listed(t: Any) -> Any:
    return t.detach().tolist() if isinstance(t, torch.Tensor) else None


class _Wire(DispatchCounter):
    """Counts the collectives, and notes the learner's function each one was called from (innermost frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.places: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _kind(func) is not None:
            frame = sys._getframe(1)
            while frame is not None and not is_learners(frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_qualname not in self.places:
                self.places.append(frame.f_code.co_qualname)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _name(cls: Any, default: str) -> str:
    return getattr(cls, "__name__", default)


def _any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (the checker's own all-reduce, outside the learner's code)."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _close(mine: Any, ref: torch.Tensor) -> bool:
    return isinstance(mine, torch.Tensor) and mine.shape == ref.shape and torch.allclose(
        mine.detach().float(), ref, atol=TOLERANCE)


def _learner_call(ctx: Any, default: str, call: Any) -> Any:
    """Run `call()` (autograd's backward, which runs the learner's hooks and Functions); a raise is noted under the
    learner's function it came from (its innermost frame), or `default`."""
    try:
        return call()
    except BaseException as exc:
        tb, part = exc.__traceback__, default
        while tb is not None:
            if is_learners(tb.tb_frame.f_code.co_filename):
                part = tb.tb_frame.f_code.co_qualname
            tb = tb.tb_next
        with learner_part(ctx, part):
            raise


def drive_tp(ctx: Any, column: type, row: type) -> dict[str, Any]:
    """On each rank: the learner's residual block x + row(GELU(column(x))) against the unsharded block, step by
    step; every rank stops at the first step that is wrong on any rank (so that no later step runs on wrong input)."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.GELU(), nn.Linear(SIZES[1], SIZES[2]))
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 1, generator=gen)     # a bias far from zero: adding it twice shows
    x, grad_out = torch.randn(BATCH, SIZES[0], generator=gen), torch.randn(BATCH, SIZES[2], generator=gen)
    world, k = ctx.world_size, SIZES[1] // ctx.world_size
    mine = slice(ctx.rank * k, (ctx.rank + 1) * k)
    # the unsharded block in one process: x is used twice (the column layer and the residual)
    ref_x = x.clone().requires_grad_()
    ref_hidden = full[0](ref_x)
    ref_hidden.retain_grad()
    ref_h = F.gelu(ref_hidden)
    ref_h.retain_grad()
    ref_mlp = full[2](ref_h)
    (ref_x + ref_mlp).backward(grad_out)
    w0, b0, w2, b2 = (t.detach() for t in (full[0].weight, full[0].bias, full[2].weight, full[2].bias))
    partial = ref_h.detach()[:, mine] @ w2[:, mine].T
    out: dict[str, Any] = {
        "rank": ctx.rank, "world": world, "stage": "init",
        "full": {"column.weight": _listed(w0), "column.bias": _listed(b0), "row.weight": _listed(w2),
                 "row.bias": _listed(b2)},
        "ref": {"hidden": _listed(ref_hidden[:, mine]), "xw": _listed(x @ w0[mine].T), "out": _listed(ref_mlp),
                "sum": _listed(ref_mlp - b2), "partial": _listed(partial), "h_grad": _listed(ref_h.grad[:, mine]),
                "x_grad": _listed(ref_x.grad), "residual": _listed(grad_out),
                "own_part": _listed(ref_hidden.grad[:, mine] @ w0[mine]), "sum_part": _listed(ref_x.grad - grad_out),
                "column.weight": _listed(full[0].weight.grad[mine]), "column.bias": _listed(full[0].bias.grad[mine]),
                "row.weight": _listed(full[2].weight.grad[:, mine]), "row.bias": _listed(full[2].bias.grad)}}
    names = _name(column, "column layer"), _name(row, "row layer")
    with learner_part(ctx, f"{names[0]}.__init__"):
        col = column(copy.deepcopy(full[0]))
    with learner_part(ctx, f"{names[1]}.__init__"):
        rw = row(copy.deepcopy(full[2]))
    kept = {"column": (col, w0[mine], b0[mine]), "row": (rw, w2[:, mine], b2)}
    out["kept"] = {f"{layer}.{name}": _listed(getattr(mod, name, None))
                   for layer, (mod, *_) in kept.items() for name in ("weight", "bias")}
    if _any_rank(not all(_close(getattr(mod, "weight", None), w) and _close(getattr(mod, "bias", None), b)
                         for mod, w, b in kept.values())):
        return out
    out["stage"] = "column"
    mine_x = x.clone().requires_grad_()
    with _Wire() as wire, learner_part(ctx, f"{names[0]}.forward"):
        hidden = col(mine_x)
    out.update(hidden=_listed(hidden), column_calls=wire.take()[0], column_places=wire.places)
    if _any_rank(not _close(hidden, ref_hidden.detach()[:, mine])):
        return out
    out["stage"] = "row"
    h = F.gelu(hidden)
    h.retain_grad()
    with _Wire() as wire, learner_part(ctx, f"{names[1]}.forward"):
        mlp = rw(h)
    out.update(out=_listed(mlp), row_calls=wire.take()[0], row_places=wire.places)
    if _any_rank(not _close(mlp, ref_mlp.detach())):
        return out
    out["stage"] = "backward"
    with _Wire() as wire:
        _learner_call(ctx, "backward", lambda: (mine_x + mlp).backward(grad_out))
    out.update(backward_calls=wire.take()[0], backward_places=wire.places, h_grad=_listed(h.grad),
               x_grad=_listed(mine_x.grad),
               grads={f"{layer}.{name}": _listed(getattr(getattr(mod, name, None), "grad", None))
                      for layer, (mod, *_) in kept.items() for name in ("weight", "bias")})
    out["stage"] = "done"
    return out
