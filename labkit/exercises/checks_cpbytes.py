"""Context parallelism's bytes worked out before the run (lesson 23): what one rank sends for ring,
all-gather and Ulysses attention, as a small pure function checked on many points and against the
bytes real gloo ranks hand their collectives.

    def cp_bytes(method, s, h, c, value_bytes):   # "ring", "allgather" or "ulysses"; sequence s,
    hidden h, CP c
        ...                                       # -> bytes that leave one rank, one layer's
                                                  forward, one sequence
    report = check_cp_bytes(cp_bytes)
    report.measured["counted"]                    # {(method, c): bytes that left rank 0, counted at
                                                  the dispatcher}
    cp_bytes = report.use(reference_cp_bytes)     # yours once it passed

The formula: a rank holds s/c positions; its K (and its V) is (s/c) x h values. Ring and all-gather
get K and V to each of the c - 1 other ranks: 2 (c - 1) (s/c) h values. Ulysses makes four
all-to-alls (q, k and v to the head split, the output back), each of (s/c) x h values of which (c -
1)/c leave (the block for the rank's own heads stays home): 4 (c - 1)/c (s/c) h values. Times
value_bytes; forward only (backward sends as much again).

    ring, allgather, ulysses   every point of a grid (s up to 131072, h up to 8192, c = 2 to 16, 2-
    and 4-byte
             values) is the formula's, judged per method; a wrong one is read as the usual slip: K
             and V (a factor 2) forgotten, c for c - 1, what an all-gather is handed (once) for what
             leaves (c - 1 times), Ulysses' four all-to-alls (q, k, v, out) counted as two or three,
             (c - 1)/c forgotten, forward and backward counted, values for bytes
    ranks    on 2 and 4 gloo ranks, labkit's context.attention runs each method (float32, s = 16, 4
             heads of 8): the bytes each rank handed each collective are counted at torch's
             dispatcher (dispatchcount.py) and turned into what left it by contextpar.WIRE_RULE;
             they must equal your number for each method
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..training.parallel import context as cp
from ..training.parallel.dispatchcount import DispatchCounter
from ..tricks.contextpar import WIRE_RULE
from .checks_formulas import close, judge_points
from .learner import learner_part, run_checked
from .report import Report

METHODS = ("ring", "allgather", "ulysses")
WORLDS, SEQ, HEADS, HEAD_DIM = (2, 4), 16, 4, 8  # the real run: h = 32, float32


def reference_cp_bytes(method: str, s: int, h: int, c: int, value_bytes: int) -> float:
    """labkit's reference: bytes that leave one rank in one attention layer's forward, for one
    sequence."""
    block = s / c * h * value_bytes  # this rank's K (or V, q, out): s/c positions of h values
    return 2 * (c - 1) * block if method in ("ring", "allgather") else 4 * (c - 1) / c * block


def _want(method: str, s: int, h: int, c: int, vb: int) -> float:
    """The checker's own count, as contextpar.expected_bytes counts: blocks that leave, times one
    block's bytes."""
    blocks = {"ring": 2 * (c - 1), "allgather": 2 * (c - 1), "ulysses": 4 * (c - 1) / c}[method]
    return blocks * (s // c) * h * vb


def _grid(method: str) -> list[tuple[str, int, int, int, int]]:
    return [
        (method, s, h, c, vb)
        for s in (1024, 131072)
        for h in (64, 8192)
        for c in (2, 3, 4, 16)
        for vb in (2, 4)
        if s % c == 0
    ] + [(method, 96, 64, 3, 4)]


def _said(case: tuple) -> str:
    method, s, h, c, vb = case
    return f"{method}, s = {s}, h = {h}, c = {c}, {vb}-byte values"


def _block(s: int, h: int, c: int, vb: int) -> float:
    return s / c * h * vb


KV = ("K and V: each rank's K and its V both travel, two blocks of (s/c) x h per other rank "
      "(a factor 2)")
C_KV = "c where c - 1 belongs: a rank sends its K and V to the c - 1 others, not to itself"
HANDED = ("that is what the rank hands the collective once; it leaves for each of the c - 1 "
          "others (c - 1 times)")
BOTH_WAYS = ("forward and backward: backward sends as much again, but the question is one "
             "layer's forward")
VALUES = "values, not bytes: multiply by value_bytes"
_KV = {
    KV: lambda m, s, h, c, vb: (c - 1) * _block(s, h, c, vb),
    C_KV: lambda m, s, h, c, vb: 2 * c * _block(s, h, c, vb),
    HANDED: lambda m, s, h, c, vb: 2 * _block(s, h, c, vb),
    BOTH_WAYS: lambda m, s, h, c, vb: 4 * (c - 1) * _block(s, h, c, vb),
    VALUES: lambda m, s, h, c, vb: 2 * (c - 1) * s / c * h,
}
TWO = "Ulysses makes four all-to-alls, q, k, v and the output; yours counts two"
THREE = "Ulysses makes four all-to-alls, q, k, v and the output back; yours counts three"
STAYS = ("(c - 1)/c forgotten: of each all-to-all's c blocks the one for this rank's own heads "
         "stays home")
C_A2A = "c where c - 1 belongs: of an all-to-all's c blocks, c - 1 leave ((c - 1)/c of the tensor)"
_ULYSSES = {
    TWO: lambda m, s, h, c, vb: 2 * (c - 1) / c * _block(s, h, c, vb),
    THREE: lambda m, s, h, c, vb: 3 * (c - 1) / c * _block(s, h, c, vb),
    STAYS: lambda m, s, h, c, vb: 4 * _block(s, h, c, vb),
    C_A2A: lambda m, s, h, c, vb: 4 * (c - 1) * _block(s, h, c, vb),
    BOTH_WAYS: lambda m, s, h, c, vb: 8 * (c - 1) / c * _block(s, h, c, vb),
    VALUES: lambda m, s, h, c, vb: 4 * (c - 1) / c * s / c * h,
}
SLIPS = {"ring": _KV, "allgather": _KV, "ulysses": _ULYSSES}


def _drive(ctx: Any, fn: Callable, name: str) -> dict[str, Any]:
    c, me = ctx.world_size, ctx.rank
    with learner_part(ctx, name):
        grid = {m: [fn(*case) for case in _grid(m)] for m in METHODS}
        yours = {m: fn(m, SEQ, HEADS * HEAD_DIM, c, 4) for m in METHODS}
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, HEADS, SEQ, HEAD_DIM).unbind(0)
    pos = cp.positions(SEQ, me, c, "contiguous")
    counted = {}
    for method in METHODS:
        with DispatchCounter() as wire:  # forward only: what this rank handed each collective
            cp.attention(
                q[:, :, pos], k[:, :, pos], v[:, :, pos], pos, method=method, split="contiguous"
            )
        counted[method] = sum(
            WIRE_RULE[kind](nbytes, c)
            for kind, (_, nbytes) in wire.take_kinds().items()
            if kind in WIRE_RULE
        )
    return {"grid": grid, "yours": yours, "counted": counted}


def check_cp_bytes(
    fn: Callable, *, worlds: tuple[int, ...] = WORLDS, timeout: float = 20.0, runs_root: Any = None
) -> Report:
    """Judge `fn(method, s, h, c, value_bytes)` on the grid and on real gloo ranks:
    check_cp_bytes(f).ok."""
    name = getattr(fn, "__name__", "cp_bytes")
    report = Report(
        f"{name}: the bytes one rank sends for ring, all-gather and Ulysses attention, on a grid "
        "and "
        f"{' and '.join(map(str, worlds))} gloo ranks",
        implementation=fn,
    )
    counted: dict[tuple[str, int], float] = {}
    for c in worlds:
        outcomes = run_checked(
            report,
            functools.partial(_drive, fn=fn, name=name),
            world_size=c,
            timeout=timeout,
            name=f"check-{name}-{c}",
            runs_root=runs_root,
            hang_hint="Your function computes a number: it needs no collective, and should "
            "not call one.",
        )
        if outcomes is None:
            return report
        if c == worlds[0]:
            grid = outcomes[0]["grid"]
            if not all(
                [
                    judge_points(
                        report,
                        m,
                        name,
                        _grid(m),
                        grid[m],
                        [_want(*p) for p in _grid(m)],
                        SLIPS[m],
                        _said,
                        "bytes",
                    )
                    for m in METHODS
                ]
            ):
                return report
        for rank, out in enumerate(outcomes):
            for method in METHODS:
                counted.setdefault((method, c), out["counted"][method])
                if not close(out["yours"][method], out["counted"][method]):
                    report.add(
                        "ranks",
                        "fail",
                        f"{method} on {c} gloo ranks (s = {SEQ}, h = {HEADS * HEAD_DIM}, "
                        f"float32): rank {rank} sent {out['counted'][method]:g} bytes, "
                        f"counted at the dispatcher; your number is "
                        f"{out['yours'][method]!r}",
                        part=name,
                    )
                    return report
    report.measured["counted"] = counted
    said = ", ".join(f"{m} {b:g}" for (m, c), b in counted.items() if c == worlds[-1])
    report.add(
        "ranks",
        "pass",
        f"every rank's bytes counted at the dispatcher are yours, each method on "
        f"{' and '.join(map(str, worlds))} ranks ({worlds[-1]} ranks: {said})",
    )
    return report
