"""Shared fixtures: a scratch runs folder per test, a check that no process outlives a launch, and the count of
gated claims at the end of the summary."""
from __future__ import annotations

import os
import time

import psutil
import pytest


def leftover_processes() -> list[psutil.Process]:
    """Descendants of this test process, except multiprocessing's interpreter-wide resource tracker (a helper
    Python starts once for spawn and keeps until exit; it is not a rank)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture
def runs_root(tmp_path):
    return tmp_path / "runs"


@pytest.fixture
def no_leftovers():
    """Fails the test if any process it started is still alive at its end."""
    yield
    left = leftover_processes()
    assert not left, f"processes left alive: {[(p.pid, p.cmdline()) for p in left]}"


# --- gated speed claims: what the lessons checked, and what they could not (labkit.measure.claims) -----------

_session_started = time.time()


@pytest.hookimpl(trylast=True)   # after the durations table: the last section before the final counts
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """At the end of the summary: 'gated claims: N checked, M skipped' (py-spy-style not_checked claims among the skipped) from the LABKIT_CLAIMS_LOG file
    (`make test` sets it), and each skipped claim by name, so that a skipped claim is seen, not buried."""
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


# --- no claim dropped: a lesson in the form logs at least as many claims as it had asserts (less the removed) ----

CLAIMS_FLOOR = os.path.join(os.path.dirname(__file__), "claims_floor.json")


def claims_below_floor(outcomes) -> list[str]:
    """For each lesson that logged claims in this session, fewer than tests/claims_floor.json holds for it: one line
    each. The floor is the lesson's assert count before it was written in the lesson form, less the asserts removed
    because they could not fail (the file says which)."""
    import json
    from labkit.measure.claims import lesson_counts
    floors = json.loads(open(CLAIMS_FLOOR).read())["floor"]
    counts = {lesson: sum(by.values()) for lesson, by in lesson_counts(outcomes).items()}
    return [f"lesson {lesson}: {n} claims logged, fewer than its floor of {floors[lesson]} (tests/claims_floor.json)"
            for lesson, n in sorted(counts.items()) if lesson in floors and n < floors[lesson]]


def pytest_sessionfinish(session, exitstatus):
    """A lesson that logged fewer claims than its floor fails the run (make test), even when every cell passed."""
    from labkit.measure.claims import LOG_ENV, read_log
    path = os.environ.get(LOG_ENV)
    if path and claims_below_floor(read_log(path, since=_session_started)) and session.exitstatus == 0:
        session.exitstatus = 1


# --- every lesson under 90 s in quick mode (the developers' guide): a lesson that passes but takes longer fails ----

LESSON_LIMIT_S = 90.0


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
