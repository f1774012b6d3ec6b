"""The MoE all-to-all's bytes per token worked out before the run (lesson 19): a small pure function
checked on many points and against the bytes real gloo ranks hand all_to_all_single under uniform
routing.

    def a2a_bytes_per_token(k, h, e, value_bytes):   # top-k routing, hidden size h, EP degree e
        ...                                          # -> bytes that leave a rank per token, one
                                                     layer's forward
    report = check_a2a_bytes(a2a_bytes_per_token)
    report.measured["counted"]                       # {e: bytes per token that left each rank,
                                                     counted}
    a2a_bytes_per_token = report.use(reference_a2a_bytes)   # yours once it passed

The formula: each token goes to k experts, a copy of h values each; under uniform routing 1/e of the
copies stay with this rank's own experts and (e - 1)/e leave; the combine sends each copy's output
back, as many bytes again. So 2 k h (e - 1)/e x value_bytes per token and layer, in forward
(backward sends as much again: not asked).

    values   every point of a grid (k = 1, 2, 8; h up to DeepSeek-V3's 7168; e = 2 to 64; 2- and
             4-byte values, the headline k = 8, h = 7168, e = 64 in bf16 included) is the formula's;
             a wrong one is read as the usual slip: k forgotten, (e - 1)/e forgotten, the dispatch
             only (no combine), values for bytes, forward and backward counted
    ranks    on e = 2 and e = 4 gloo ranks, labkit's reference dispatch and combine
             (all_to_all_single) move each rank's tokens under routing that is exactly uniform; the
             float32 bytes each rank hands all_to_all_single for the other ranks are counted at the
             call, and must equal your number per token for (k, h, e, 4) (the count exchange, one
             integer per rank, is not value bytes and is left out)
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .checks_a2a import a2a_combine, a2a_dispatch
from .checks_formulas import close, judge_points
from .learner import learner_part, run_checked
from .report import Report

WORLDS, TOP_K, WIDTH, TOKENS = (
    (2, 4),
    2,
    8,
    12,
)  # the real run: TOKENS a multiple of every world, TOP_K <= world


def reference_a2a_bytes(k: int, h: int, e: int, value_bytes: int) -> float:
    """labkit's reference: bytes leaving a rank per token, one MoE layer's forward (dispatch +
    combine)."""
    return 2 * k * h * value_bytes * (e - 1) / e


def _want(k: int, h: int, e: int, value_bytes: int) -> float:
    """The checker's own count: k copies of h values; (e - 1)/e leave; out and back again."""
    copies_leaving = k * (e - 1) / e
    return (copies_leaving * h * value_bytes) * 2


def _grid() -> list[tuple[int, int, int, int]]:
    return [
        (k, h, e, vb)
        for k in (1, 2, 8)
        for h in (8, 4096, 7168)
        for e in (2, 4, 64)
        for vb in (2, 4)
    ]


def _said(case: tuple) -> str:
    k, h, e, vb = case
    return f"k = {k}, h = {h}, e = {e}, {vb}-byte values"


NO_K = "k forgotten: top-k routing sends k copies of each token, one per chosen expert"
NO_LEAVE = ("(e - 1)/e forgotten: under uniform routing 1/e of the copies go to this rank's own "
            "experts and never leave it")
DISPATCH = ("the dispatch only: the combine sends every copy's output back, as many bytes again "
            "(a factor 2)")
VALUES = "values, not bytes: multiply by value_bytes (2 in bf16, 4 in float32)"
BOTH_WAYS = ("forward and backward: backward sends as much again, but the question is one layer's "
             "forward")
_SLIPS: dict[str, Callable[..., float]] = {
    NO_K: lambda k, h, e, vb: 2 * h * vb * (e - 1) / e,
    NO_LEAVE: lambda k, h, e, vb: 2 * k * h * vb,
    DISPATCH: lambda k, h, e, vb: k * h * vb * (e - 1) / e,
    VALUES: lambda k, h, e, vb: 2 * k * h * (e - 1) / e,
    BOTH_WAYS: lambda k, h, e, vb: 4 * k * h * vb * (e - 1) / e,
}


@contextlib.contextmanager
def counted_all_to_all(me: int) -> Iterator[list[int]]:
    """Count the bytes of floating-point rows this rank hands dist.all_to_all_single for the
    other ranks (its
    own chunk stays home; the count exchange, integers, is not value bytes)."""
    leaving = [0]
    original = dist.all_to_all_single

    def counting(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if input.is_floating_point() and input.numel():
            n = dist.get_world_size()
            sizes = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
            row = input[0].numel() * input.element_size()
            leaving[0] += sum(size for peer, size in enumerate(sizes) if peer != me) * row
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        yield leaving
    finally:
        dist.all_to_all_single = original


def _drive(ctx: Any, fn: Callable, name: str) -> dict[str, Any]:
    e, me = ctx.world_size, ctx.rank
    with learner_part(ctx, name):
        grid = [fn(*case) for case in _grid()]
        yours = fn(TOP_K, WIDTH, e, 4)
    torch.manual_seed(me)
    tokens = torch.randn(TOKENS, WIDTH)
    # uniform routing, exactly: token t's j-th expert is (t + j) mod e (one expert per rank)
    experts = torch.tensor([(t + j) % e for t in range(TOKENS) for j in range(TOP_K)])
    rows = tokens.repeat_interleave(TOP_K, dim=0)  # one row per (token, chosen expert)
    with counted_all_to_all(me) as leaving:
        received, plan = a2a_dispatch(rows, experts, e)
        back = a2a_combine(received * 2.0, plan)
    assert torch.allclose(back, rows * 2.0)  # the reference moved every row out and back
    return {"grid": grid, "yours": yours, "counted": leaving[0] / TOKENS}


def check_a2a_bytes(
    fn: Callable, *, worlds: tuple[int, ...] = WORLDS, timeout: float = 20.0, runs_root: Any = None
) -> Report:
    """Judge `fn(k, h, e, value_bytes)` on the grid and on real gloo ranks:
    check_a2a_bytes(f).ok."""
    name = getattr(fn, "__name__", "a2a_bytes_per_token")
    report = Report(
        f"{name}: the all-to-all bytes per token of top-k routing, on {len(_grid())} points and "
        f"{' and '.join(map(str, worlds))} gloo ranks",
        implementation=fn,
    )
    counted: dict[int, float] = {}
    for e in worlds:
        outcomes = run_checked(
            report,
            functools.partial(_drive, fn=fn, name=name),
            world_size=e,
            timeout=timeout,
            name=f"check-{name}-{e}",
            runs_root=runs_root,
            hang_hint="Your function computes a number: it needs no collective, and should "
            "not call one.",
        )
        if outcomes is None:
            return report
        if e == worlds[0]:
            cases = _grid()
            if not judge_points(
                report,
                "values",
                name,
                cases,
                outcomes[0]["grid"],
                [_want(*c) for c in cases],
                _SLIPS,
                _said,
                "bytes per token",
            ):
                return report
        counted[e] = outcomes[0]["counted"]
        for rank, out in enumerate(outcomes):
            if not close(out["yours"], out["counted"]):
                report.add(
                    "ranks",
                    "fail",
                    f"{e} gloo ranks, k = {TOP_K}, h = {WIDTH}, float32, uniform routing: "
                    f"rank {rank} handed all_to_all_single {out['counted']:g} bytes per "
                    f"token for the other ranks, your number is {out['yours']!r}",
                    part=name,
                )
                return report
    report.measured["counted"] = counted
    said = ", ".join(f"{b:g} at e = {e}" for e, b in counted.items())
    report.add(
        "ranks",
        "pass",
        f"every rank's bytes per token counted at all_to_all_single ({said}; k = {TOP_K}, "
        f"h = {WIDTH}, float32) are yours",
    )
    return report
