"""Build tensor parallelism yourself: a column-parallel and a row-parallel linear layer, checked on 2 gloo ranks.

    class MyColumnParallelLinear(nn.Module): ...   # (full: nn.Linear): this rank's rows of the weight (its outputs)
    class MyRowParallelLinear(nn.Module): ...      # (full: nn.Linear): this rank's columns (its inputs), all-reduce
    report = check_tp(MyColumnParallelLinear, MyRowParallelLinear)
    MyColumnParallelLinear, MyRowParallelLinear = report.use(TP_REFERENCE)   # yours if they passed

Both layers are built on every rank from the same unsharded nn.Linear and keep `weight` and `bias` (their part).
The checker runs a residual block, x + row(GELU(column(x))), on each rank on the same input: x is used twice, as in
a transformer's residual stream, so a backward all-reduce that sums more than the column layer's own share of x's
gradient shows. Each step is compared with the unsharded block in one process, and a step is checked only once the
steps before it are right, so that a failure is blamed on the learner's function that made it:

    runs         every rank finished (a raise names the rank, the function and its line; a hang each rank's place)
    kept         each layer's weight and bias are this rank's slice of the unsharded layer's (in __init__); another
                 rank's slice, the whole tensor or a wrong shape is named
    column       the column layer's output is x @ weight.T + bias of the rows it keeps (its forward)
    output       the row layer's output is the sum over the ranks of their partial outputs plus the bias once (its
                 forward): what it computed instead is said in those terms (its own partial sum, the bias counted
                 world_size times, the sum taken twice, ...)
    gradients    the row layer's input and parameter gradients (its forward's backward: the sum must pass the
                 gradient through), then x's gradient (the column layer's backward must sum each rank's part, and
                 only that: not the residual's share, not twice) and the column layer's parameters' gradients
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .learner import run_checked
from .report import Report
from .tp_rank import TOLERANCE, _name, drive_tp



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


def check_tp(column: type, row: type, *, world_size: int = 2, timeout: float = 30.0, runs_root: Any = None) -> Report:
    """Run the residual block x + `row`(GELU(`column`(x))) on `world_size` gloo ranks against the unsharded block
    and report what is right and wrong with the two layers:  check_tp(*TP_REFERENCE).ok."""
    layers = Layers(column, row)
    report = Report(f"{layers.__name__}: a residual column -> row MLP on {world_size} gloo ranks",
                    implementation=layers)
    got = run_checked(report, functools.partial(drive_tp, column=column, row=row), world_size=world_size,
                      timeout=timeout, name="check-tp", runs_root=runs_root)
    if got is None:
        return report
    report.add("runs", "pass", f"every rank finished on {world_size} ranks")
    names = _name(column, "column layer"), _name(row, "row layer")
    if (_kept(report, got, names) and _column(report, got, names) and _row(report, got, names)
            and _gradients(report, got, names)):
        report.measured.update(forward_allreduces=got[0]["column_calls"] + got[0]["row_calls"],
                               backward_allreduces=got[0]["backward_calls"])
    return report


def _t(value: Any) -> torch.Tensor | None:
    return torch.tensor(value) if value is not None else None


def _where(part: str, places: list[str]) -> str:
    """`part`, and the learner's other functions its collectives were called from (a helper it calls)."""
    others = [p for p in places if p != part and not part.endswith("." + p)]
    return part + "".join(f" → {p}" for p in others)


def _fit(target: torch.Tensor, bases: dict[str, torch.Tensor]) -> dict[str, float] | None:
    """The coefficients c with target = sum of c[name]·bases[name] (each rounded to 3 decimals), if it is one."""
    a = torch.stack([b.reshape(-1).double() for b in bases.values()], 1)
    y = target.reshape(-1).double()
    if not a.shape[0] or y.shape[0] != a.shape[0]:
        return None
    c = torch.linalg.lstsq(a, y[:, None]).solution[:, 0]
    if (a @ c - y).abs().max().item() > 1e-3 * max(1.0, y.abs().max().item()):
        return None
    return {name: round(v, 3) + 0.0 for name, v in zip(bases, c.tolist())}


def _said(coeffs: dict[str, float]) -> str:
    terms = [f"{v:g}·({name})" for name, v in coeffs.items() if abs(v) > 1e-6]
    return " + ".join(terms).replace("+ -", "- ") or "0"


def _kept(report: Report, got: list[dict[str, Any]], names: tuple[str, str]) -> bool:
    """Each layer's weight and bias on each rank against this rank's slice of the unsharded layer's."""
    for r in got:
        world, rank = r["world"], r["rank"]
        for key in ("column.weight", "column.bias", "row.weight", "row.bias"):
            layer, name = key.split(".")
            part = f"{names[layer == 'row']}.__init__"
            full, mine = _t(r["full"][key]), _t(r["kept"][key])
            dim = 1 if key == "row.weight" else None if key == "row.bias" else 0
            slices = [full if dim is None else full.narrow(dim, s * full.shape[dim] // world,
                                                           full.shape[dim] // world) for s in range(world)]
            want = slices[0] if dim is None else slices[rank]
            if mine is not None and mine.shape == want.shape and torch.allclose(mine, want, atol=TOLERANCE):
                continue
            what = {0: "rows", 1: "columns", None: "the whole"}[dim]
            should = (f"the whole {name} ({tuple(full.shape)})" if dim is None else
                      f"{what} {rank}·k .. {rank + 1}·k of the unsharded {name} (k = {full.shape[dim] // world}, "
                      f"shape {tuple(want.shape)})")
            if mine is None:
                said = f"it keeps no tensor named {name}: the exercise asks for nn.Linear's names (weight, bias)"
            elif mine.shape == full.shape and torch.allclose(mine, full, atol=TOLERANCE):
                said = f"it keeps the whole unsharded {name}"
            elif mine.shape != want.shape:
                said = f"it keeps a {name} of shape {tuple(mine.shape)}"
            else:
                owners = [s for s, sl in enumerate(slices) if torch.allclose(mine, sl, atol=TOLERANCE)]
                said = (f"it keeps rank {owners[0]}'s {what} of the {name}" if owners
                        else f"its {name} is no rank's slice of the unsharded one")
            report.add("kept", "fail", f"the {layer} layer on rank {rank}: {said}; rank {rank} keeps {should}",
                       part=part)
            return False
    report.add("kept", "pass", "each rank's layers keep their own slice of the unsharded weights and biases")
    return True


def _column(report: Report, got: list[dict[str, Any]], names: tuple[str, str]) -> bool:
    """The column layer's output on each rank against x @ weight.T + bias of the rows it keeps."""
    part = f"{names[0]}.forward"
    for r in got:
        if r["stage"] != "column":
            continue
        ref, hidden = _t(r["ref"]["hidden"]), _t(r["hidden"])
        where = _where(part, r["column_places"])
        if hidden is None or hidden.shape != ref.shape:
            report.add("column", "fail", f"on rank {r['rank']} it returned "
                       f"{'no tensor' if hidden is None else 'shape ' + str(tuple(hidden.shape))}, expected "
                       f"{tuple(ref.shape)}: this rank's output features, x @ weight.T + bias", part=where)
            return False
        bias = _t(r["full"]["column.bias"]).reshape(r["world"], -1)[r["rank"]].expand_as(ref)
        fit = _fit(hidden, {"x @ weight.T": _t(r["ref"]["xw"]), "bias": bias})
        said = f"it computed {_said(fit)}" if fit else \
            f"it differs from x @ weight.T + bias by up to {(hidden - ref).abs().max().item():.2g}"
        calls = f" ({r['column_calls']} collective(s) ran in it)" if r["column_calls"] else ""
        report.add("column", "fail", f"rank {r['rank']}'s output features are wrong although the layer keeps the "
                   f"right rows: {said}{calls}; the forward is F.linear(x, weight, bias), with no collective",
                   part=where)
        return False
    report.add("column", "pass", "each rank's column layer computed its own features of the unsharded output")
    return True


def _row(report: Report, got: list[dict[str, Any]], names: tuple[str, str]) -> bool:
    """The row layer's output on each rank (given the right input) against the sum of the ranks' partial outputs
    plus the bias once; what it computed instead is said in those terms."""
    part = f"{names[1]}.forward"
    bad = [r for r in got if r["stage"] == "row"]
    if not bad:
        report.add("output", "pass", "every rank's output equals the unsharded MLP's")
        return True
    world = got[0]["world"]
    for r in bad:
        ref, mine = _t(r["ref"]["out"]), _t(r["out"])
        where = _where(part, r["row_places"])
        if mine is None or mine.shape != ref.shape:
            report.add("output", "fail", f"on rank {r['rank']} it returned "
                       f"{'no tensor' if mine is None else 'shape ' + str(tuple(mine.shape))}, expected "
                       f"{tuple(ref.shape)} (every output feature, on every rank)", part=where)
            return False
        if torch.allclose(mine, ref, atol=TOLERANCE):
            continue
        bias = _t(r["full"]["row.bias"]).expand_as(ref)
        fit = _fit(mine, {"the sum over the ranks of their partial outputs": _t(r["ref"]["sum"]),
                          "this rank's own partial output": _t(r["ref"]["partial"]), "the bias": bias})
        calls = r["row_calls"]
        ran = "no collective ran in it" if not calls else f"{calls} collective(s) ran in it"
        if fit and fit == {**dict.fromkeys(fit, 0.0), "this rank's own partial output": 1.0, "the bias": 1.0}:
            why = (f"rank {r['rank']}'s output is its own partial sum ({ran}): the row layer must sum the ranks' "
                   "partial outputs (dist.all_reduce), then add the bias")
        elif fit and list(fit.values()) == [1.0, 0.0, float(world)]:
            why = (f"the bias is counted {world} times: each rank added it before the all-reduce summed the ranks' "
                   "outputs; add it once, after the sum")
        elif fit:
            why = (f"rank {r['rank']}'s output is {_said(fit)} ({ran}), although its input and its kept weight "
                   "are right; it must be 1·(the sum over the ranks of their partial outputs) + 1·(the bias)")
        else:
            why = (f"rank {r['rank']}'s output differs from the sum over the ranks of their partial outputs plus "
                   f"the bias by up to {(mine - ref).abs().max().item():.2g} and is no combination of the partial "
                   f"outputs and the bias ({ran}), although its input and its kept weight are right")
        report.add("output", "fail", why, part=where)
        return False
    report.add("output", "fail", "the output was wrong on another rank", part=part)
    return False


def _ratio(mine: torch.Tensor, ref: torch.Tensor) -> float | None:
    fit = _fit(mine, {"ref": ref})
    return fit["ref"] if fit else None


def _gradients(report: Report, got: list[dict[str, Any]], names: tuple[str, str]) -> bool:
    """The row layer's gradients (its input's, its weight's and bias's), then x's and the column layer's."""
    column, row = f"{names[0]}.forward", f"{names[1]}.forward"
    world = got[0]["world"]
    for r in got:
        rank, ref = r["rank"], r["ref"]
        places = r["backward_places"]
        for key, label in (("h_grad", "the gradient of the row layer's input"), ("row.weight", "row.weight's"),
                           ("row.bias", "row.bias's")):
            mine, want = _t(r["h_grad"] if key == "h_grad" else r["grads"][key]), _t(ref[key])
            if mine is not None and mine.shape == want.shape and torch.allclose(mine, want, atol=TOLERANCE):
                continue
            if mine is None:
                said = f"{label} gradient is missing: keep the layer's parameters and its sum in autograd's graph"
            else:
                k = _ratio(mine, want) if mine.shape == want.shape else None
                said = (f"{label} gradient is {k:g}× the unsharded one's" if k is not None else
                        f"{label} gradient differs from the unsharded one's by up to "
                        f"{(mine - want).abs().max().item():.2g}" if mine.shape == want.shape else
                        f"{label} gradient has shape {tuple(mine.shape)}, expected {tuple(want.shape)}")
            report.add("gradients", "fail", f"on rank {rank}, {said}: the row layer's sum must pass the gradient "
                       "through unchanged in backward (Megatron's g), and its own part of the output is "
                       "F.linear(x, weight)", part=_where(row, places))
            return False
        mine_x = _t(r["x_grad"])
        if mine_x is None:
            report.add("gradients", "fail", "x has no gradient: keep the column layer in autograd's graph",
                       part=column)
            return False
        if not torch.allclose(mine_x, _t(ref["x_grad"]), atol=TOLERANCE):
            fit = _fit(mine_x, {"the residual's gradient": _t(ref["residual"]), "this rank's part": _t(ref["own_part"]),
                                "every rank's part, summed": _t(ref["sum_part"])})
            res, own, total = fit.values() if fit else (None, None, None)
            if fit and (res, own, total) == (1.0, 1.0, 0.0):
                why = ("x's gradient on each rank has only its own part of the column layer's: the column layer's "
                       "backward must sum it over the ranks (a hook on a node of its own, or an autograd Function: "
                       "the input as it is in forward, dist.all_reduce of its gradient in backward)")
            elif fit and (res, own, total) == (float(world), 0.0, 1.0):
                why = (f"x's gradient is {_said(fit)}: the all-reduce summed x's whole gradient, the residual's "
                       f"share too (off by {world - 1}× the residual's gradient). The hook sits on x itself: hook "
                       "a node of the layer's own (x.view_as(x)), or use an autograd Function, so that only this "
                       "layer's share is summed")
            elif fit:
                why = (f"x's gradient is {_said(fit)}; the unsharded block's is 1·(the residual's gradient) + "
                       "1·(every rank's part, summed): the column layer's backward must sum its own share of x's "
                       "gradient over the ranks once")
            else:
                why = (f"x's gradient differs from the unsharded block's by up to "
                       f"{(mine_x - _t(ref['x_grad'])).abs().max().item():.2g}, and is no combination of the "
                       "residual's gradient and the ranks' parts")
            report.add("gradients", "fail", f"on rank {rank}, {why}", part=_where(column, places))
            return False
        for key in ("column.weight", "column.bias"):
            mine, want = _t(r["grads"][key]), _t(ref[key])
            if mine is None or mine.shape != want.shape or not torch.allclose(mine, want, atol=TOLERANCE):
                k = _ratio(mine, want) if mine is not None and mine.shape == want.shape else None
                said = "is missing" if mine is None else f"is {k:g}× the unsharded one's" if k is not None else \
                    "differs from the unsharded one's"
                report.add("gradients", "fail", f"on rank {rank}, {key}'s gradient {said} although the gradient "
                           "reaching the column layer's output is right", part=_where(column, places))
                return False
    report.add("gradients", "pass", "the row layer's input, x (through the residual and the column layer) and every "
               "kept weight and bias get the unsharded block's gradient")
    return True
