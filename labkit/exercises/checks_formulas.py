"""A learner's small pure function judged on many points against labkit's formula, its wrong values
read as the usual slip that gives the same numbers everywhere (shared by checks_bubble,
checks_moebytes and checks_cpbytes).

    ok = judge_points(report, "bubble", "pipeline_costs", cases, got, want, slips, said)

`cases` are the argument tuples, `got` the learner's values at each (computed inside a rank, under
learner_part, so that a raise names the learner's line), `want` the formula's, `slips` {the sentence
naming a slip: the slip's formula of the same arguments}, `said(case)` a case in words. A failure
names the first slip whose values equal the learner's at every point; otherwise it gives the first
wrong point, the learner's value and the formula's.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .report import Report

REL = 1e-6


def close(got: Any, want: float, rel: float = REL) -> bool:
    """Whether `got` is a number within `rel` of `want` (False for a value that is no number)."""
    try:
        return abs(float(got) - want) <= rel * max(abs(want), 1e-12)
    except (TypeError, ValueError, OverflowError):   # not a number, or an int too large for a float
        return False


def _safe(slip: Callable[..., float], case: tuple) -> float | None:
    try:
        return slip(*case)
    except ZeroDivisionError:
        return None  # a point where the slip's formula has no value cannot tell


def judge_points(
    report: Report,
    check: str,
    part: str,
    cases: Sequence[tuple],
    got: Sequence[Any],
    want: Sequence[float],
    slips: dict[str, Callable[..., float]],
    said: Callable[[tuple], str],
    what: str = "value",
) -> bool:
    """Add one verdict on `check` to `report`; True when every point equals the formula's."""
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if not close(g, w)]
    if not wrong:
        report.add(check, "pass", f"all {len(cases)} points are the formula's {what}")
        return True
    for why, slip in slips.items():
        values = [_safe(slip, case) for case in cases]
        if all(v is None or close(g, v) for g, v in zip(got, values)):
            i = wrong[0]
            report.add(
                check,
                "fail",
                f"{why} ({said(cases[i])}: yours {_num(got[i])}, the formula's {_num(want[i])})",
                part=part,
            )
            return False
    i = wrong[0]
    report.add(
        check,
        "fail",
        f"{said(cases[i])}: your {what} is {_num(got[i])}, the formula's {_num(want[i])} "
        f"({len(wrong)} of {len(cases)} points wrong, and none of the usual slips: work it "
        "out again from the definition)",
        part=part,
    )
    return False


def said_number(value: Any) -> str:
    """A learner's number as a message shows it: 1,234,567 or 1.23457e+15; repr() of what is no finite number."""
    try:
        return f"{float(value):,.6g}" if math.isfinite(float(value)) else repr(value)
    except (TypeError, ValueError, OverflowError):
        return repr(value)


def _num(value: Any) -> str:
    try:
        return f"{float(value):.6g}"
    except (TypeError, ValueError):
        return repr(value)
