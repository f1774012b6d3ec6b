"""Answers that are a number or a name, written before the cell that measures them, and judged.

    BUSBW = ...                       # ✏️ your number   (the stub: blanks.py turns a solution's line into this)
    report = check_number(BUSBW, "bus bandwidth (GB/s)", formula=2 * (n - 1) / n * size / t,
                          measured=fitted, slips={"the algorithm bandwidth, without 2(n-1)/n": size / t})
    BUSBW = report.use(formula)       # yours once it passed; the formula's number until then

    report = check_name(STRAGGLER, "the straggler", want=1, wrong={0: "rank 0 is the one the others waited for"})

A number is judged against the formula (within `rel`), then against the measurement where one is given (within
`measured_rel`: the model against this machine, a note when they part, since the model is what was asked for). A
wrong number that equals one of the usual slips (bytes for parameters, N for N - 1, a factor 2 forgotten...) is
named as that slip; any other is said as a ratio to the formula. `...` (Ellipsis), the stub's value, is "not written
yet": the lesson goes on with the reference `use` is given. A name (a rank, a collective, a field) is judged by
equality, and a known wrong answer is told why it is wrong.
"""
from __future__ import annotations

import math
from typing import Any

from .report import Report

ANSWER_MARK = "# ✏️"   # on a solution's line `NAME = value  # ✏️ ...`: blanks.py makes it `NAME = ...  # ✏️ ...`


def _number(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-300)


def check_number(value: Any, name: str, *, formula: float, measured: float | None = None, rel: float = 0.02,
                 measured_rel: float = 0.5, slips: dict[str, float] | None = None, unit: str = "") -> Report:
    """Judge a learner's number against `formula` (and `measured`): check_number(x, "bytes", formula=4e9).ok."""
    report = Report(f"your {name}", implementation=value)
    if value is Ellipsis:
        report.add("written", "missing", f"{name} is not written yet: replace the ... with your number")
        return report
    got = _number(value)
    if got is None:
        report.add("a number", "fail", f"{name} is {value!r} ({type(value).__name__}), not a finite number",
                   part=name)
        return report
    said = f"{got:.4g}{unit}"
    report.measured.update({"value": got, "formula": formula, "measured": measured})
    if _close(got, formula, rel):
        report.add("formula", "pass", f"{said} is the formula's {formula:.4g}{unit} (within {rel:.0%})")
    else:
        slip = next((why for why, wrong in (slips or {}).items() if _close(got, wrong, rel)), None)
        ratio = got / formula if formula else math.inf
        if slip is not None:
            report.add("formula", "fail", f"{said} is {ratio:.3f}x the formula's {formula:.4g}{unit}: {slip}",
                       part=name)
        else:
            report.add("formula", "fail", f"{said} is {ratio:.3f}x the formula's {formula:.4g}{unit}, and none of "
                                          "the usual slips: work it out again from the definition", part=name)
        return report
    if measured is not None:
        apart = abs(measured / formula - 1) if formula else math.inf
        status = "pass" if apart <= measured_rel else "note"
        report.add("measured", status, f"this machine measured {measured:.4g}{unit}, {apart:.0%} from the formula"
                   + ("" if status == "pass" else ": the model and this machine part here (the number asked for is "
                                                   "the model's)"))
    return report


def check_name(value: Any, name: str, *, want: Any, wrong: dict[Any, str] | None = None) -> Report:
    """Judge a learner's answer that is a name, a rank or a choice: check_name(r, "the straggler", want=1).ok."""
    report = Report(f"your {name}", implementation=value)
    if value is Ellipsis:
        report.add("written", "missing", f"{name} is not written yet: replace the ... with your answer")
    elif value == want:
        report.add("answer", "pass", f"{value!r} is right")
    elif wrong and value in wrong:
        report.add("answer", "fail", f"{value!r} is not {name}: {wrong[value]}", part=name)
    else:
        report.add("answer", "fail", f"{value!r} is not {name}", part=name)
    return report
