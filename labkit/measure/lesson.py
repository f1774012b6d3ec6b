"""A lesson's claims, one readable line each, and the table the lesson ends with.

    claims = labkit.Claims("07")
    claims.check("2 ranks x 16 give 1 x 32's loss", gap < 1e-5, measured=f"max gap {gap:.1e}")
    # prints:  ✓ 07: 2 ranks x 16 give 1 x 32's loss — max gap 3.1e-06
    claims.gated("2 workers cut the step time", workers_cut_the_wait, timed)   # a speed claim: through the gate
    claims.table()                                   # claim | measured here | verdict, one row per claim

A claim that does not hold raises ClaimFailed (an AssertionError, so a test or nbmake fails) with the measured
values in its message. Every outcome, checked, failed or not checked, is appended to the LABKIT_CLAIMS_LOG file as
the gate's outcomes are, its text starting with the lesson's number ("07: ..."), so that `make test` can say per
lesson how many claims were checked, failed and not checked (claims.lesson_lines).

Speed claims never go through `check`: a timing compared outside the gate passes or fails with the load of the
machine (tests/test_lesson_rules.py reads every lesson for that). `gated`, `not_checked` and `checked_unless` are
those of labkit.measure.claims, with the lesson's number put in front of the claim and the outcome kept for the table.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import pandas as pd

from . import claims as _claims
from .bounds import Bound
from .claims import MARK, Outcome, line, shown

LESSON = re.compile(r"^\d\d[a-z]?$")
VERDICT = {"checked": "holds", "failed": "does not hold", "skipped": "not checked"}


class ClaimFailed(AssertionError):
    """A lesson's claim that the measurement did not bear out; its message holds the measured values."""


def _bounds(ok: Any) -> list[Bound]:
    """The Bounds a claim's condition is made of: one (below(gap, 1e-5)), a list or tuple of them, or none."""
    if isinstance(ok, Bound):
        return [ok]
    if isinstance(ok, (list, tuple)) and ok and all(isinstance(b, Bound) for b in ok):
        return list(ok)
    return []


def _truth(claim: str, ok: Any) -> bool:
    """`ok` as a bool (a list of Bounds: all of them hold); a table or a tensor of several values must be reduced
    first (.all(), .any())."""
    if _bounds(ok):
        return all(b.holds for b in _bounds(ok))
    try:
        return bool(ok)
    except (ValueError, RuntimeError) as error:
        raise TypeError(f"claim {claim!r}: its condition is {type(ok).__name__} of several values; reduce it with "
                        f".all() or .any() ({error})") from None


class Claims:
    """The claims of one lesson, each checked and shown in one line, kept for the closing table.

        claims = Claims("09")
        claims.check("every rank stopped at step 7", set(stops) == {7}, measured=stops)

    A cell run twice checks its claims again; the table keeps each claim's latest outcome."""

    def __init__(self, lesson: str):
        if not isinstance(lesson, str) or not LESSON.match(lesson):
            raise ValueError(f"lesson = {lesson!r}: must be the lesson's number as two digits, e.g. '07'")
        self.lesson = lesson
        self.outcomes: dict[str, Outcome] = {}

    def __repr__(self) -> str:
        counts = {s: sum(o.status == s for o in self.outcomes.values()) for s in MARK}
        return (f"Claims({self.lesson!r}: {counts['checked']} checked, {counts['failed']} failed, "
                f"{counts['skipped']} not checked)")

    def named(self, claim: str) -> str:
        """The claim as the log holds it: '07: the claim' (a claim that already starts with '07: ' is kept)."""
        if not isinstance(claim, str) or not claim.strip():
            raise ValueError(f"claim = {claim!r}: say what is claimed, in words")
        return claim if claim.startswith(f"{self.lesson}: ") else f"{self.lesson}: {claim}"

    def check(self, claim: str, ok: Any, measured: Any = None) -> Outcome:
        """Check a claim that is not about speed, print one line, record it, raise ClaimFailed if it does not hold:

            claims.check("the ranks end bitwise equal", equal, measured=f"{n} tensors compared")

        ok: the claim's condition, computed from what the ranks did (a bool, or a one-element tensor or array), or
        a measure.below/above Bound (or a list of them) when the claim holds a varying number against a limit: then
        the log keeps its margin, and a failure says the value and the limit.
        measured: what to show beside it (a number, text, a dict or a list); it goes into the table too."""
        name, text = self.named(claim), shown(measured)
        holds, bounds = _truth(claim, ok), _bounds(ok)
        missed = "; ".join(str(b) for b in bounds if not b.holds)
        reason = "" if holds else f"measured: {text}" + (f" ({missed})" if missed else "")
        outcome = _claims.record(Outcome(name, "checked" if holds else "failed", 1, [], 0.0, reason, measured=text,
                                         kind="check", bounds=_claims.kept(bounds)))
        self.outcomes[name] = outcome
        print(line(outcome))
        if not holds:
            raise ClaimFailed(f"{name} -- does not hold; measured here: {text or '(nothing given)'}"
                              + (f" ({missed})" if missed else ""))
        return outcome

    def gated(self, claim: str, check: Callable[[Any], Any], measured: Any = None, **options: Any) -> Outcome:
        """A speed claim through labkit.measure.gated (checked on quiet cores, or not checked with the reason):

            claims.gated("2 workers cut the step time", workers_cut_the_wait, timed)

        check(measurement) asserts; what it returns is shown as the measured value."""
        return self._keep(lambda name: _claims.gated(name, check, measured, **options), claim)

    def not_checked(self, claim: str, reason: str) -> Outcome:
        """A claim this machine cannot check (no GPU, ptrace refused), counted and shown as not checked."""
        return self._keep(lambda name: _claims.not_checked(name, reason), claim)

    def checked_unless(self, reason: str | None, claim: str, check: Callable[[Any], Any],
                       measured: Any = None) -> Outcome:
        """check(measured) where this machine can (reason is None), else not checked for `reason`."""
        return self._keep(lambda name: _claims.checked_unless(reason, name, check, measured), claim)

    def _keep(self, decide: Callable[[str], Outcome], claim: str) -> Outcome:
        name = self.named(claim)
        try:
            outcome = decide(name)
        except AssertionError as failure:
            self.outcomes[name] = Outcome(name, "failed", 1, [], 0.0, str(failure)[:500], kind="gated")
            raise
        self.outcomes[name] = outcome
        return outcome

    def table(self) -> "ClaimTable":
        """The lesson's claims as a table, one row per claim: claim | measured here | verdict."""
        rows = [{"claim": o.claim.removeprefix(f"{self.lesson}: "), "measured here": o.measured or "",
                 "verdict": VERDICT[o.status] + (f" ({o.reason})" if o.status == "skipped" else "")}
                for o in self.outcomes.values()]
        table = ClaimTable(rows, columns=["claim", "measured here", "verdict"])
        table.index = range(1, len(table) + 1)
        return table


class ClaimTable(pd.DataFrame):
    """A DataFrame that a notebook shows whole and left-aligned: a claim is a sentence, not a number to truncate."""

    @property
    def _constructor(self):
        return pd.DataFrame   # what is computed from it is a plain table

    def _repr_html_(self) -> str:
        left = [("text-align", "left"), ("white-space", "normal")]
        return (self.style.set_properties(**dict(left))
                .set_table_styles([{"selector": "th", "props": left}]).to_html())

