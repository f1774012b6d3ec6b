"""What a checker hands back: each check's verdict in one sentence, and the numbers it measured.

    report = check_ddp(MyDDP)          # in a notebook the report prints itself
    report.ok                          # True when nothing failed and nothing is missing
    report.measured["grad_ratio"]      # the numbers behind the sentences, for the lesson's own asserts
    MyDDP = report.use(NaiveDDP)       # yours if it passed; see below otherwise

A stub not written yet (NotImplementedError, and nothing wrong) is reported as NOT WRITTEN YET, and `use` hands back
labkit's reference, said out loud, so that the rest of the lesson runs while you write yours: a lesson ships its
exercises as stubs. Code that is written and wrong stops the lesson: `use` (and `require`) raise ExerciseFailed with
the report's text, except in blank mode (LABKIT_EXERCISES=blank, which a blank copy sets), where it is said and the
reference used.

The standard every checker meets (issue 46; tests/test_checker_standard.py and each checker's tests hold it, and
`python tools/mutants.py` measures it):
- it compares the learner's code with a reference independent of it, on the properties a wrong solution breaks
  (values, balance, what a residual or a second use of a tensor exposes, async work waited for before use), checked
  deterministically, never by timing;
- a failure names the learner's function it blames (`report.add(..., part="combine")`, shown as "(in your
  combine)"; `report.blamed` lists them) and a cause that is true of the code it saw, in words a learner can act on;
- a correct solution written another way (other collectives, another balanced sharding) passes, or is told which
  requirement of the exercise it misses;
- a hang names each rank's place in the learner's code and the call it waits in, a crash the rank and the learner's
  line (learner.report_failure), never a frame of labkit's;
- it runs on the world sizes the exercise promises.
"""
from __future__ import annotations

import ast
import linecache
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODE_ENV = "LABKIT_EXERCISES"
STATUSES = ("pass", "fail", "missing", "note")
_MARKS = {"pass": "✓", "fail": "✗", "missing": "…", "note": "·"}


GRADERS_ENV = "NBGRADER_EXECUTION"   # nbgrader sets it in the kernel it grades with ("autograde", "validate")


def grade_mode() -> bool:
    """True when a notebook is being graded (LABKIT_EXERCISES=grade, or nbgrader's autograde or validate): a stub
    not written yet raises in its checker cell, as a wrong solution does."""
    return os.environ.get(MODE_ENV, "").strip().lower() == "grade" or \
        os.environ.get(GRADERS_ENV, "").strip().lower() in ("autograde", "validate")


def blank_mode() -> bool:
    """True when LABKIT_EXERCISES=blank (and not grading): checkers report what is missing instead of failing the
    notebook."""
    return os.environ.get(MODE_ENV, "").strip().lower() == "blank" and not grade_mode()


class ExerciseFailed(AssertionError):
    """An exercise did not pass its checker (outside blank mode); the message is the checker's report."""


@dataclass(frozen=True)
class Finding:
    """One check's verdict: `check` names what was checked, `status` is pass/fail/missing/note."""

    check: str
    status: str
    message: str
    part: str = ""   # the learner's function or method a failure blames ("combine", "MyDDP.finish_..."), if known

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status = {self.status!r}: must be one of {STATUSES}")

    def line(self) -> str:
        blamed = f" (in your {self.part})" if self.part and self.status == "fail" else ""
        return f"{_MARKS[self.status]} {self.check}{blamed}: {self.message}"


@dataclass
class Report:
    """A checker's findings about one implementation, and what it measured (see the module docstring)."""

    subject: str
    findings: list[Finding] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None
    implementation: Any = None

    def add(self, check: str, status: str, message: str, part: str = "") -> None:
        """One verdict; a failure names `part`, the learner's function it blames, wherever the checker can tell."""
        self.findings.append(Finding(check, status, message, part))

    @property
    def blamed(self) -> list[str]:
        """The learner's functions the failures name, in order, each once ([] when none is named)."""
        return list(dict.fromkeys(f.part for f in self.findings if f.status == "fail" and f.part))

    @property
    def ok(self) -> bool:
        return not any(f.status in ("fail", "missing") for f in self.findings)

    @property
    def failures(self) -> list[str]:
        """The messages of the checks that failed, in the order they were made."""
        return [f.message for f in self.findings if f.status == "fail"]

    @property
    def missing(self) -> list[str]:
        """What is not written yet (NotImplementedError), one message per part."""
        return [f.message for f in self.findings if f.status == "missing"]

    def status(self, check: str) -> str | None:
        """The worst status among the findings named `check` (None if that check was not made)."""
        found = [f.status for f in self.findings if f.check == check]
        for worst in ("missing", "fail", "pass", "note"):
            if worst in found:
                return worst
        return None

    def text(self) -> str:
        verdict = "PASSED" if self.ok else ("NOT WRITTEN YET" if self.missing and not self.failures else "FAILED")
        lines = [f"{self.subject}: {verdict}"] + ["  " + f.line() for f in self.findings]
        if self.run_dir is not None and self.failures:
            lines.append(f"  (ranks' logs: {self.run_dir})")
        return "\n".join(lines)

    __str__ = text

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def require(self) -> bool:
        """Raise ExerciseFailed if something written is wrong (blank mode: print it instead; grading: raise for a
        stub not written yet too); True if it passed, False if it is not written yet."""
        if self.ok:
            return True
        if grade_mode():   # graded: not written scores nothing, as wrong code does
            raise ExerciseFailed(self.text())
        if not self.failures:
            print(f"[not written yet] {self.subject}: the report above says what is left.")
            return False
        if blank_mode():
            print(f"[blank mode] {self.subject}: not passing yet; the checker's report is above.")
            return False
        raise ExerciseFailed(self.text())

    def use(self, reference: Any = None) -> Any:
        """The checked implementation if it passed; labkit's `reference` (said out loud) if it is not written yet, or
        in blank mode, so that the lesson can go on; otherwise raise ExerciseFailed with the report."""
        if grade_mode() and not self.ok:
            _assign_in_caller(sys._getframe(1), reference)   # the lesson goes on with the reference
        if self.require():
            return self.implementation
        why = "[not written yet]" if not self.failures else "[blank mode]"
        print(f"{why} the cells below use labkit's {getattr(reference, '__name__', reference)} until yours passes.")
        return reference


def _assign_in_caller(frame: Any, reference: Any) -> None:
    """Graded, a checker cell raises, so it scores nothing; but the lesson must go on with labkit's reference, as it
    does for a learner, or every later cell fails too. So the names a top-level `NAME = report.use(reference)` (or
    `A, B = ...`) in a notebook cell assigns are given the reference before the raise. Best effort: anything else
    is left alone."""
    if frame is None or frame.f_globals is not frame.f_locals:
        return
    try:
        tree = ast.parse("".join(linecache.getlines(frame.f_code.co_filename)))
    except (SyntaxError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.lineno <= frame.f_lineno <= node.end_lineno \
                and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                frame.f_globals[target.id] = reference
            elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts) \
                    and isinstance(reference, tuple) and len(reference) == len(target.elts):
                frame.f_globals.update({t.id: value for t, value in zip(target.elts, reference)})
            return
