"""A claim's number held against its limit, kept so that the room a claim has can be read from its log.

    def everyone_slowed(timed):                    # a gated claim's check
        grew = ...                                 # ms per rank
        assert above(grew.min(), 0.5 * DELAY_MS, "least step growth (ms)"), grew

    claims.check("2 ranks x 16 give 1 x 32's loss", below(gap, 1e-5, "max loss gap"), measured=gap)

`below(value, limit)` and `above(value, limit)` return a Bound: true when the value is on the claimed side of the
limit. Its margin is how far the value sits from the limit, as a fraction of the limit (0.25: a quarter of the
limit to spare; negative: the claim failed by that much). A gate (measure.claims.gated) collects every Bound its
check made and writes them into the claims log beside the outcome; `tools/margins.py` reads many runs' logs and
tables each claim's worst margin, so that a claim whose measurement swings close to its limit is seen before it
flakes. When a check fails, the gate's reason names the bound that did not hold, with its value and limit.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
from typing import Any, Iterator

OPS = {"<": "below", ">": "above"}
_collected: contextvars.ContextVar[list["Bound"] | None] = contextvars.ContextVar("labkit_bounds", default=None)


@dataclasses.dataclass(frozen=True)
class Bound:
    """One measured value against one limit: `value op limit` is the claim (op "<" or ">")."""
    value: float
    limit: float
    op: str
    what: str = ""

    @property
    def holds(self) -> bool:
        return self.value < self.limit if self.op == "<" else self.value > self.limit

    @property
    def margin(self) -> float | None:
        """(limit - value) / |limit| for "<", (value - limit) / |limit| for ">"; None for a limit of 0, where a
        fraction of the limit means nothing (such a claim is exact, not a matter of room)."""
        if self.limit == 0 or not (math.isfinite(self.value) and math.isfinite(self.limit)):
            return None
        room = self.limit - self.value if self.op == "<" else self.value - self.limit
        return room / abs(self.limit)

    def __bool__(self) -> bool:
        return self.holds

    def __str__(self) -> str:
        name = f"{self.what}: " if self.what else ""
        verb = ("is" if self.holds else "is not") + f" {OPS[self.op]}"
        margin = "" if self.margin is None else f" (margin {self.margin:+.0%})"
        return f"{name}{self.value:.4g} {verb} {self.limit:.4g}{margin}"

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "value": self.value, "op": self.op, "limit": self.limit, "margin": self.margin}


def _number(name: str, x: Any) -> float:
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:   # a numpy or torch scalar
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} = {x!r}: must be one number (reduce a table or a tensor first: .max(), .min())")
    return float(x)


def _bound(value: Any, limit: Any, op: str, what: str) -> Bound:
    bound = Bound(_number("value", value), _number("limit", limit), op, what)
    kept = _collected.get()
    if kept is not None:
        kept.append(bound)
    return bound


def below(value: Any, limit: Any, what: str = "") -> Bound:
    """The claim `value < limit`, kept with its margin:  assert below(ratio, 0.75, "2 workers / 0 workers")."""
    return _bound(value, limit, "<", what)


def above(value: Any, limit: Any, what: str = "") -> Bound:
    """The claim `value > limit`, kept with its margin:  assert above(speedup, 1.1, "speed-up")."""
    return _bound(value, limit, ">", what)


@contextlib.contextmanager
def collecting() -> Iterator[list[Bound]]:
    """Every Bound made inside the block, in order:  with collecting() as bounds: check(measured)."""
    kept: list[Bound] = []
    token = _collected.set(kept)
    try:
        yield kept
    finally:
        _collected.reset(token)


def worst(bounds: list[Bound]) -> Bound | None:
    """The bound with the least margin (a failed one first; None when none has a margin)."""
    scored = [b for b in bounds if b.margin is not None]
    return min(scored, key=lambda b: b.margin) if scored else None
