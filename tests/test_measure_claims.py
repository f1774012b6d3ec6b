"""The claims gate, with fake measurements: retries while busy, bounded; checks when quiet; records every outcome."""
from __future__ import annotations

import json
import os

import pytest

from labkit.measure import claims
from labkit.measure.claims import gated, read_log, summary_lines


class Fake:
    """A measurement whose others' cores are set by the test; `again()` yields the next one of a scripted list."""

    def __init__(self, script, made):
        self.others, self.value = script[0]
        self.script, self.made = script, made
        made.append(self)

    def again(self):
        return Fake(self.script[1:], self.made)


@pytest.fixture(autouse=True)   # every test here writes to its own log, never to the one make test counts
def log(tmp_path, monkeypatch):
    path = tmp_path / "claims.jsonl"
    monkeypatch.setenv(claims.LOG_ENV, str(path))
    claims.reset_retries()      # and starts with the whole retry budget, as a lesson's kernel does
    yield path
    claims.reset_retries()


def test_busy_then_quiet_is_checked_after_a_retry(log, capsys):
    made, seen = [], []
    first = Fake([(0.9, "busy"), (0.1, "quiet")], made)
    outcome = gated("fast", lambda m: seen.append(m.value), first, limit=0.3, attempts=3)
    assert outcome.status == "checked" and outcome.attempts == 2 and outcome.others == [0.9, 0.1]
    assert seen == ["quiet"] and len(made) == 2           # the check ran once, on the quiet measurement
    assert "✓ fast — others kept 0.10 cores busy, after 1 busy measurement" in capsys.readouterr().out
    assert [o.status for o in read_log(log)] == ["checked"]


def test_always_busy_is_skipped_after_a_bounded_number_of_attempts(log, capsys):
    made, seen = [], []
    outcome = gated("slow", lambda m: seen.append(m), Fake([(1.2, None)] * 10, made), limit=0.3, attempts=3)
    assert outcome.status == "skipped" and outcome.attempts == 3 and len(made) == 3 and seen == []
    out = capsys.readouterr().out
    assert "○ slow — NOT CHECKED: " in out and "1.20 to 1.20 cores" in out
    row = json.loads(log.read_text())
    assert row["claim"] == "slow" and row["status"] == "skipped" and row["others"] == [1.2, 1.2, 1.2]


def test_a_failing_check_fails_and_is_recorded_as_failed(log):
    def check(m):
        assert m.value > 1, "too slow"
    with pytest.raises(AssertionError, match="too slow"):
        gated("wrong", check, Fake([(0.0, 0)], []))
    (outcome,) = read_log(log)
    assert outcome.status == "failed" and "too slow" in outcome.reason


def test_a_quiet_first_measurement_is_not_measured_again(log):
    made = []
    assert gated("once", lambda m: None, Fake([(claims.LIMIT_CORES, 1)], made)).checked   # at the limit: quiet
    assert len(made) == 1


def test_any_measurement_works_with_measure_and_others():
    fakes = iter([{"busy": 2.0}, {"busy": 0.0}])
    outcome = gated("dicts", lambda m: None, measure=lambda: next(fakes), others=lambda m: m["busy"])
    assert outcome.checked and outcome.attempts == 2


def test_without_a_log_nothing_is_written(monkeypatch, tmp_path):
    monkeypatch.delenv(claims.LOG_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    gated("no log", lambda m: None, Fake([(0.0, 1)], []))
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="attempts = 0"):
        gated("x", lambda m: None, Fake([(0.0, 1)], []), attempts=0)
    with pytest.raises(ValueError, match="nothing to measure with"):
        gated("x", lambda m: None, {"others": 0.0})


def test_the_summary_counts_and_names_the_skipped(log):
    gated("a", lambda m: None, Fake([(0.0, 1)], []))
    gated("b", lambda m: None, Fake([(5.0, 1)], []), attempts=1)
    lines = summary_lines(read_log(log))
    assert lines[0] == "gated claims: 1 checked, 1 skipped"
    assert len(lines) == 2 and lines[1].startswith("  SKIPPED: b -- other programs kept 5.00")
    assert read_log(log, since=read_log(log)[-1].time + 1) == []   # an earlier session's lines are not counted


def test_make_test_prints_the_count_at_the_end(tmp_path):
    """The conftest hook, in a real pytest run: a notebook-like test records a skipped claim; the summary shows it."""
    import subprocess
    import sys
    from pathlib import Path
    test = tmp_path / "test_fake_lesson.py"
    test.write_text("from labkit.measure.claims import gated, not_checked\n"
                    "class M:\n    others = 3.0\n    def again(self):\n        return M()\n"
                    "def test_lesson():\n    gated('busy claim', lambda m: None, M(), attempts=2, wait=lambda limit: 3.0)\n"
                    "    gated('quiet claim', lambda m: None, M(), others=lambda m: 0.0)\n"
                    "    not_checked('py-spy claim', 'ptrace is not permitted here')\n")
    (tmp_path / "conftest.py").write_text((Path(__file__).parent.parent / "conftest.py").read_text())
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "claims_floor.json").write_text(Path(__file__).with_name("claims_floor.json").read_text())
    log = tmp_path / "claims.jsonl"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], cwd=tmp_path,
                         capture_output=True, text=True,   # no plugin autoload: nbmake and playwright cost 6 s here
                         env={**os.environ, claims.LOG_ENV: str(log), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gated claims: 1 checked, 2 skipped" in out.stdout
    assert "SKIPPED: busy claim" in out.stdout and "SKIPPED: py-spy claim -- ptrace is not permitted" in out.stdout


def test_a_gate_waits_for_quiet_before_measuring_again_and_gives_up_if_it_stays_busy(log, capsys):
    made, waits = [], []
    busy = gated("busy", lambda m: None, Fake([(0.9, 1)] * 5, made), wait=lambda limit: waits.append(limit) or 0.8)
    assert busy.status == "skipped" and busy.attempts == 1 and len(made) == 1 and waits == [claims.LIMIT_CORES]
    assert "then still 0.80 while waiting" in busy.reason
    claims.reset_retries()
    made = []
    calm = gated("calm", lambda m: None, Fake([(0.9, 1), (0.0, 2)], made), wait=lambda limit: 0.05)
    assert calm.checked and calm.attempts == 2 and len(made) == 2


def test_after_a_wait_that_ended_busy_the_next_busy_claim_is_skipped_without_waiting(log):
    waits = []
    gated("first", lambda m: None, Fake([(0.9, 1)] * 3, []), wait=lambda limit: waits.append(limit) or 0.9)
    second = gated("second", lambda m: None, Fake([(0.9, 1)] * 3, []), wait=lambda limit: waits.append(limit) or 0.0)
    assert len(waits) == 1 and second.status == "skipped" and second.attempts == 1
    assert "still busy after a wait" in second.reason
    assert gated("quiet", lambda m: None, Fake([(0.0, 1)], [])).checked   # a quiet measurement is checked as ever


def test_waiting_and_measuring_again_share_one_budget_per_process(log, monkeypatch):
    monkeypatch.setenv(claims.BUDGET_ENV, "0.2")
    clock = iter(range(1000))
    monkeypatch.setattr(claims.time, "monotonic", lambda: next(clock) * 0.1)  # every look at the clock: 0.1 s on
    made = []
    first = gated("first", lambda m: None, Fake([(0.9, 1)] * 5, made), wait=lambda limit: 0.0, attempts=5)
    assert first.status == "skipped" and 2 <= first.attempts < 5 and "are spent" in first.reason
    second = gated("second", lambda m: None, Fake([(0.9, 1)] * 5, []), wait=lambda limit: 0.0)
    assert second.attempts == 1 and "are spent" in second.reason
    monkeypatch.setenv(claims.BUDGET_ENV, "0")
    claims.reset_retries()
    assert gated("never again", lambda m: None, Fake([(0.9, 1)] * 5, []), wait=lambda limit: 0.0).attempts == 1


def test_a_claim_this_machine_cannot_check_is_counted_as_skipped_with_its_reason(log, capsys):
    outcome = claims.not_checked("12: py-spy dumps the ranks", "ptrace is not permitted here")
    assert outcome.status == "skipped" and outcome.attempts == 0
    assert "○ 12: py-spy dumps the ranks — NOT CHECKED: ptrace is not permitted here" in capsys.readouterr().out
    assert summary_lines(read_log(log)) == ["gated claims: 0 checked, 1 skipped",
                                            "  SKIPPED: 12: py-spy dumps the ranks -- ptrace is not permitted here"]
    with pytest.raises(ValueError, match="say why"):
        claims.not_checked("x", "")


def test_metered_measures_any_function_on_pinned_cores_and_again_on_demand(log):
    from labkit.measure import metered, together
    calls = []
    first = metered(lambda: calls.append(os.sched_getaffinity(0)) or len(calls), cores=1)
    assert first.value == 1 and len(calls[0]) == 1 and first.seconds >= 0 and first.others >= 0
    second = first.again()
    assert second.value == 2 and second.cores == 1
    both = together(first, second)
    assert both.others == max(first.others, second.others) and both.again()[1].value == 4
    checked = gated("metered", lambda m: None, first, others=lambda m: 0.0)
    assert checked.checked
    with pytest.raises(ValueError, match="know their others"):
        together({"others": 0.0})
