"""make test's hooks, for the tests (tests/) and the lessons (notebooks/, run by nbmake) alike: a conftest.py under
tests/ would not apply to notebooks/ (pytest calls a runtest hook from the conftests on the item's own path).

- At the end of a session: 'gated claims: N checked, M skipped' and each lesson's claims (LABKIT_CLAIMS_LOG).
- A lesson that logged fewer claims than its floor (tests/claims_floor.json) fails the session.
- A lesson that took over LESSON_LIMIT_S in quick mode fails, with its time.
- LABKIT_LESSONS=timed or untimed: only the lessons with speed claims (a `.gated(` call), or only those without.
  make test runs the untimed lessons beside the tests, two at a time, and the timed ones after, one at a time.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
CLAIMS_FLOOR = ROOT / "tests" / "claims_floor.json"
LESSON_LIMIT_S = 90.0
LESSONS_ENV = "LABKIT_LESSONS"

_session_started = time.time()


def claims_below_floor(outcomes) -> list[str]:
    """For each lesson that logged claims in this session, fewer than tests/claims_floor.json holds: one line each."""
    from labkit.measure.claims import floor_lines
    return floor_lines(outcomes, json.loads(CLAIMS_FLOOR.read_text())["floor"])


@pytest.hookimpl(trylast=True)   # after the durations table: the last section before the final counts
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """At the end of the summary: 'gated claims: N checked, M skipped' (py-spy-style not_checked claims among the
    skipped) from the LABKIT_CLAIMS_LOG file (`make test` sets it), each skipped claim by name, so that a skipped
    claim is seen, not buried, and each lesson's claims."""
    from labkit.measure.claims import LOG_ENV, lesson_lines, read_log, summary_lines
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    outcomes = read_log(path, since=_session_started)
    lines = summary_lines(outcomes)
    skipped = any(o.status != "checked" for o in outcomes)
    terminalreporter.section("gated claims", yellow=skipped, bold=skipped)
    for line in lines:
        terminalreporter.write_line(line, yellow=skipped, bold=line is lines[0])
    per_lesson = lesson_lines(outcomes)
    if per_lesson:
        short = claims_below_floor(outcomes)
        failed = any(o.status == "failed" for o in outcomes) or bool(short)
        terminalreporter.section("claims per lesson", red=failed, bold=failed)
        for line in per_lesson:
            terminalreporter.write_line(line)
        for line in short:
            terminalreporter.write_line(line, red=True, bold=True)


def pytest_sessionfinish(session, exitstatus):
    """A lesson that logged fewer claims than its floor fails the run (make test), even when every cell passed."""
    from labkit.measure.claims import LOG_ENV, read_log
    if hasattr(session.config, "workerinput"):   # an xdist worker: the other may be mid-lesson; the controller judges
        return
    path = os.environ.get(LOG_ENV)
    if path and claims_below_floor(read_log(path, since=_session_started)) and session.exitstatus == 0:
        session.exitstatus = 1


def timed_lesson(path: Path) -> bool:
    """Whether a lesson makes a speed claim (calls `.gated(`): such a lesson runs alone, on quiet cores."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    return any(".gated(" in "".join(c["source"]) for c in cells if c["cell_type"] == "code")


def pytest_collection_modifyitems(config, items):
    """LABKIT_LESSONS=timed keeps only the lessons with speed claims, untimed only the others (tests stay). Under
    pytest-xdist the lessons go first: they are the longest items, and a worker handed one last would leave the other
    idle (pytest collected tests/ first even when notebooks/ was named first)."""
    if hasattr(config, "workerinput"):   # an xdist worker: the controller hands items out in its collection's order
        items.sort(key=lambda item: not str(item.fspath).endswith(".ipynb"))   # stable: each group keeps its order
    which = os.environ.get(LESSONS_ENV, "")
    if not which:
        return
    if which not in ("timed", "untimed"):
        raise pytest.UsageError(f"{LESSONS_ENV}={which!r}: use 'timed' or 'untimed' (or leave it unset: every lesson)")
    keep, drop = [], []
    for item in items:
        lesson = str(item.fspath).endswith(".ipynb")
        (drop if lesson and timed_lesson(item.fspath) != (which == "timed") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A notebook run by nbmake in quick mode that took more than LESSON_LIMIT_S is reported as failed, with its
    time: a learner waits seconds, not minutes, and CI's whole run has a budget."""
    outcome = yield
    report = outcome.get_result()
    quick = os.environ.get("LABKIT_QUICK", "") not in ("", "0", "false", "False")
    if (quick and report.when == "call" and report.passed and str(item.fspath).endswith(".ipynb")
            and report.duration > LESSON_LIMIT_S):
        report.outcome = "failed"
        report.longrepr = (f"{item.name} passed but took {report.duration:.0f} s in quick mode; a lesson must take "
                           f"under {LESSON_LIMIT_S:.0f} s (make it smaller in quick mode: labkit.pick)")
