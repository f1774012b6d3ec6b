"""Build tensor parallelism yourself: a column-parallel and a row-parallel linear layer, checked on 2 gloo ranks.

    class MyColumnParallelLinear(nn.Module): ...   # (full: nn.Linear): this rank's rows of the weight (its outputs)
    class MyRowParallelLinear(nn.Module): ...      # (full: nn.Linear): this rank's columns (its inputs), all-reduce
    report = check_tp(MyColumnParallelLinear, MyRowParallelLinear)
    MyColumnParallelLinear, MyRowParallelLinear = report.use(TP_REFERENCE)   # yours if they passed

Both layers are built on every rank from the same unsharded nn.Linear and keep `weight` and `bias` (their part).
The checker runs the MLP column -> GELU -> row on each rank on the same input and compares with the unsharded MLP
in one process: the column layer's output (this rank's features), the MLP's output, the gradient of the input,
and each kept weight's and bias's gradient against the matching slice of the unsharded one's.

What is checked, and the mistakes told apart from what each rank computed:
    runs         every rank finished (a collective that one rank skips hangs: reported, bounded by a timeout)
    slices       the column layer's output on rank r is features r·k .. (r+1)·k of the unsharded output; another
                 rank's slice, or a wrong shape, is named
    output       equal on every rank to the unsharded MLP's; else: each rank's output is its partial sum (no
                 all-reduce), or the bias counted world_size times (added on every rank before the all-reduce)
    gradients    the input's gradient and every kept parameter's; else: the input gradient is each rank's part
                 (the column layer's backward all-reduce is missing), or every gradient is world_size times too
                 large (an all-reduce in the row layer's backward that should pass the gradient through)
"""
from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..training.parallel.dispatchcount import DispatchCounter
from .learner import learner_part, run_checked
from .report import Report

TOLERANCE = 1e-5
SIZES = (8, 16, 8)    # input, hidden (split over the ranks), output features
BATCH = 4


class _Copy(torch.autograd.Function):
    """Megatron's f: the input as it is in forward; in backward, the sum of every rank's input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _Sum(torch.autograd.Function):
    """Megatron's g: the sum of every rank's partial output in forward; the gradient as it is in backward."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _part(size: int) -> slice:
    rank, world = dist.get_rank(), dist.get_world_size()
    return slice(rank * size // world, (rank + 1) * size // world)


class ColumnParallelLinear(nn.Module):
    """The reference: this rank's rows of the weight and bias (its output features); input gradient summed."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        rows = _part(full.out_features)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_Copy.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The reference: this rank's columns of the weight (its input features); partial outputs summed, bias once."""

    def __init__(self, full: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[:, _part(full.in_features)].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sum.apply(F.linear(x, self.weight)) + self.bias


class Layers(tuple):
    """(column, row): the two layer classes, as check_tp takes them and report.use hands them back (unpack it)."""

    def __new__(cls, column: type, row: type) -> "Layers":
        return super().__new__(cls, (column, row))

    @property
    def __name__(self) -> str:
        return " and ".join(getattr(layer, "__name__", repr(layer)) for layer in self)


TP_REFERENCE = Layers(ColumnParallelLinear, RowParallelLinear)


def _listed(t: Any) -> Any:
    return t.detach().tolist() if isinstance(t, torch.Tensor) else None


def drive_tp(ctx: Any, column: type, row: type) -> dict[str, Any]:
    """On each rank: the learner's column -> GELU -> row MLP against the unsharded MLP, on the same numbers."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.GELU(), nn.Linear(SIZES[1], SIZES[2]))
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 1, generator=gen)     # a bias far from zero: adding it twice shows
    x, grad_out = torch.randn(BATCH, SIZES[0], generator=gen), torch.randn(BATCH, SIZES[2], generator=gen)
    ref_x = x.clone().requires_grad_()
    ref_hidden = full[0](ref_x)
    full[2](F.gelu(ref_hidden)).backward(grad_out)
    with learner_part(ctx, f"{getattr(column, '__name__', 'column layer')}.__init__"):
        col = column(copy.deepcopy(full[0]))
    with learner_part(ctx, f"{getattr(row, '__name__', 'row layer')}.__init__"):
        rw = row(copy.deepcopy(full[2]))
    mine_x = x.clone().requires_grad_()
    with DispatchCounter() as wire:
        with learner_part(ctx, "forward"):
            hidden = col(mine_x)
            out = rw(F.gelu(hidden))
        forward = wire.take()[0]
        with learner_part(ctx, "backward"):
            out.backward(grad_out)
        backward = wire.take()[0]
    return {"rank": ctx.rank, "world": ctx.world_size, "hidden": _listed(hidden), "out": _listed(out),
            "x_grad": _listed(mine_x.grad), "forward_calls": forward, "backward_calls": backward,
            "ref_hidden": _listed(ref_hidden), "ref_x_grad": _listed(ref_x.grad),
            "grads": {f"{layer}.{name}": (_listed(getattr(getattr(mod, name, None), "grad", None)),
                                          _listed(getattr(ref, name).grad))
                      for layer, mod, ref in (("column", col, full[0]), ("row", rw, full[2]))
                      for name in ("weight", "bias")},
            "ref_out": _listed(full[2](F.gelu(full[0](x))).detach()), "partial_bias": _listed(full[2].bias)}


def check_tp(column: type, row: type, *, world_size: int = 2, timeout: float = 30.0, runs_root: Any = None) -> Report:
    """Run the MLP `column` -> GELU -> `row` on `world_size` gloo ranks against the unsharded MLP and report what is
    right and wrong with the two layers:  check_tp(*TP_REFERENCE).ok."""
    layers = Layers(column, row)
    report = Report(f"{layers.__name__}: a column -> row MLP on {world_size} gloo ranks", implementation=layers)
    got = run_checked(report, functools.partial(drive_tp, column=column, row=row), world_size=world_size,
                      timeout=timeout, name="check-tp", runs_root=runs_root)
    if got is None:
        return report
    report.add("runs", "pass", f"every rank finished on {world_size} ranks")
    report.measured.update(forward_allreduces=got[0]["forward_calls"], backward_allreduces=got[0]["backward_calls"])
    if _slices(report, got) and _output(report, got):
        _gradients(report, got)
    return report


def _slices(report: Report, got: list[dict[str, Any]]) -> bool:
    """The column layer's output on each rank against each rank's slice of the unsharded hidden features."""
    ref = torch.tensor(got[0]["ref_hidden"])
    world, k = len(got), ref.shape[1] // len(got)
    for r in got:
        hidden = torch.tensor(r["hidden"]) if r["hidden"] is not None else None
        if hidden is None or hidden.shape != (ref.shape[0], k):
            shape = None if hidden is None else tuple(hidden.shape)
            report.add("slices", "fail", f"the column layer on rank {r['rank']} returned shape {shape}, expected "
                       f"{(ref.shape[0], k)}: keep out_features // world_size rows of the weight and of the bias")
            return False
        owners = [s for s in range(world) if torch.allclose(hidden, ref[:, s * k:(s + 1) * k], atol=TOLERANCE)]
        if r["rank"] not in owners:
            said = (f"it computed rank {owners[0]}'s features" if owners else "its output is no rank's slice")
            report.add("slices", "fail", f"wrong slice on rank {r['rank']}: {said}; rank r keeps rows r·k .. (r+1)·k "
                       f"of the weight and bias (k = {k}, use dist.get_rank())")
            return False
    report.add("slices", "pass", f"each rank's column layer computed its own {k} of the {ref.shape[1]} features")
    return True


def _output(report: Report, got: list[dict[str, Any]]) -> bool:
    """The MLP's output on every rank against the unsharded MLP's; the usual mistakes told apart."""
    ref, bias = torch.tensor(got[0]["ref_out"]), torch.tensor(got[0]["partial_bias"])
    outs = [torch.tensor(r["out"]) if r["out"] is not None else None for r in got]
    if any(o is None or o.shape != ref.shape for o in outs):
        report.add("output", "fail", f"the row layer's output has shape {[None if o is None else tuple(o.shape) for o in outs]}, "
                   f"expected {tuple(ref.shape)} on every rank")
        return False
    worst = max((o - ref).abs().max().item() for o in outs)
    report.measured["output_error"] = worst
    if worst <= TOLERANCE:
        report.add("output", "pass", f"every rank's output equals the unsharded MLP's (largest difference {worst:.1e})")
        return True
    world = len(got)
    if all(torch.allclose(o, ref + (world - 1) * bias, atol=1e-4) for o in outs):
        why = (f"the bias is counted {world} times: each rank added it before the all-reduce summed the ranks' "
               "outputs; add it once, after the sum")
    elif torch.allclose(sum(outs) - (world - 1) * bias, ref, atol=1e-4) or got[0]["forward_calls"] == 0:
        why = ("each rank's output is its own partial sum (no all-reduce in forward): the row layer must sum "
               "the ranks' partial outputs with dist.all_reduce, then add the bias")
    else:
        why = f"the output differs from the unsharded MLP's by up to {worst:.2g}"
    report.add("output", "fail", why)
    return False


def _gradients(report: Report, got: list[dict[str, Any]]) -> None:
    """The input's gradient and each kept parameter's gradient against the unsharded MLP's (the matching slice)."""
    world = len(got)
    ref_x = torch.tensor(got[0]["ref_x_grad"])
    xs = [torch.tensor(r["x_grad"]) if r["x_grad"] is not None else None for r in got]
    if any(x is None for x in xs):
        report.add("gradients", "fail", "the input has no gradient: keep the layers in autograd's graph")
        return
    worst, ratios = {}, {}
    for r in got:
        k = SIZES[1] // world
        part = slice(r["rank"] * k, (r["rank"] + 1) * k)
        for name, (mine, ref) in r["grads"].items():
            if mine is None:
                report.add("gradients", "fail", f"{name} has no gradient on rank {r['rank']}: keep it as a "
                           "parameter named like nn.Linear's (weight, bias)")
                return
            ref = torch.tensor(ref)
            ref = ref[:, part] if name == "row.weight" else ref if name == "row.bias" else ref[part]
            mine = torch.tensor(mine)
            if mine.shape != ref.shape:
                report.add("gradients", "fail", f"{name} on rank {r['rank']} has shape {tuple(mine.shape)}, "
                           f"expected {tuple(ref.shape)}")
                return
            worst[name] = max(worst.get(name, 0.0), (mine - ref).abs().max().item())
            ratios[name] = (mine.abs().sum() / max(ref.abs().sum().item(), 1e-12)).item()
    report.measured["param_grad_error"] = max(worst.values())
    x_error = max((x - ref_x).abs().max().item() for x in xs)
    report.measured["input_grad_error"] = x_error
    if all(abs(ratio - world) < 0.05 * world for ratio in ratios.values()):
        report.add("gradients", "fail", f"every parameter's gradient is {world} times too large: the row layer's "
                   "all-reduce must pass the gradient through unchanged in backward (Megatron's g), not sum it")
    elif x_error > TOLERANCE:
        summed = torch.allclose(sum(xs), ref_x, atol=1e-4)
        report.add("gradients", "fail", "the input's gradient on each rank is its own part"
                   + (" (their sum is the right one)" if summed else "")
                   + ": the column layer's backward must all-reduce it (a hook on its input, or an autograd Function: "
                   "the input as it is in forward, dist.all_reduce of its gradient in backward)")
    elif max(worst.values()) > TOLERANCE:
        wrong = ", ".join(name for name, error in worst.items() if error > TOLERANCE)
        report.add("gradients", "fail", f"the gradients of {wrong} differ from the matching slice of the unsharded "
                   f"MLP's (largest difference {max(worst.values()):.2g})")
    else:
        report.add("gradients", "pass", f"the input's and every kept weight's and bias's gradient match the unsharded "
                   f"MLP's (input: largest difference {x_error:.1e})")
