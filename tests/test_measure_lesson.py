"""A lesson's claims (labkit.measure.lesson.Claims): one line each, a failure that names the measured values, every
outcome in the claims log under the lesson's number, the closing table, and make test's per-lesson counts."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from labkit.measure import ClaimFailed, Claims, claims
from labkit.measure.claims import Outcome, lesson_lines, read_log, summary_lines


@pytest.fixture(autouse=True)   # every test here writes to its own log, never to the one make test counts
def log(tmp_path, monkeypatch):
    path = tmp_path / "claims.jsonl"
    monkeypatch.setenv(claims.LOG_ENV, str(path))
    claims.reset_retries()
    yield path
    claims.reset_retries()


def test_a_claim_that_holds_prints_one_line_and_is_logged_under_its_lesson(log, capsys):
    lesson = Claims("07")
    outcome = lesson.check("2 ranks x 16 give 1 x 32's loss", 3.1e-6 < 1e-5, measured=3.1e-6)
    assert capsys.readouterr().out == "✓ 07: 2 ranks x 16 give 1 x 32's loss — 3.1e-06\n"
    assert outcome.status == "checked" and outcome.kind == "check"
    (row,) = read_log(log)
    assert row.claim == "07: 2 ranks x 16 give 1 x 32's loss" and row.measured == "3.1e-06"


def test_a_claim_that_does_not_hold_raises_with_the_measured_values_and_is_logged_failed(log, capsys):
    lesson = Claims("09")
    with pytest.raises(ClaimFailed, match=r"09: every rank stopped at step 7 -- does not hold; measured here: 7, 8"):
        lesson.check("every rank stopped at step 7", False, measured=[7, 8])
    assert isinstance(ClaimFailed("x"), AssertionError)   # nbmake and pytest fail on it like on an assert
    assert capsys.readouterr().out.startswith("✗ 09: every rank stopped at step 7 — measured: 7, 8")
    assert [o.status for o in read_log(log)] == ["failed"]


def test_conditions_and_measured_values_of_every_kind(capsys):
    lesson = Claims("00")
    lesson.check("a tensor", torch.tensor(True), measured=torch.tensor(0.5))
    lesson.check("numpy", np.bool_(True), measured={"gap": np.float64(2e-7), "steps": 20})
    with pytest.raises(TypeError, match="reduce it with .all"):
        lesson.check("a column", pd.Series([True, False]))
    with pytest.raises(TypeError, match="reduce it with .all"):
        lesson.check("a tensor of several", torch.tensor([True, True]))
    out = capsys.readouterr().out.splitlines()
    assert out == ["✓ 00: a tensor — 0.5", "✓ 00: numpy — gap 2e-07, steps 20"]


def test_bad_lesson_numbers_and_empty_claims_are_refused():
    for bad in ("7", 7, "lesson 7", ""):
        with pytest.raises(ValueError, match="two digits"):
            Claims(bad)
    with pytest.raises(ValueError, match="say what is claimed"):
        Claims("01").check("  ", True)


def test_gated_and_not_checked_claims_read_the_same_way_and_join_the_table(log, capsys):
    class Quiet:
        others = 0.0

        def again(self):
            return self
    lesson = Claims("05")
    lesson.gated("2 workers cut the step time", lambda m: "12.0 vs 18.0 ms", Quiet())
    lesson.not_checked("FP8 is faster on a GPU", "no GPU here")
    lesson.check("05: already numbered", True)
    out = capsys.readouterr().out.splitlines()
    assert out == ["✓ 05: 2 workers cut the step time — 12.0 vs 18.0 ms (others kept 0.00 cores busy)",
                   "○ 05: FP8 is faster on a GPU — NOT CHECKED: no GPU here",
                   "✓ 05: already numbered"]
    table = lesson.table()
    assert list(table.columns) == ["claim", "measured here", "verdict"] and list(table.index) == [1, 2, 3]
    assert table.loc[2, "verdict"] == "not checked (no GPU here)" and table.loc[3, "claim"] == "already numbered"
    assert table.loc[1, "verdict"] == "holds"
    assert [o.kind for o in read_log(log)] == ["gated", "gated", "check"]


def test_a_failing_gated_claim_is_in_the_table_as_failed():
    class Quiet:
        others = 0.0

        def again(self):
            return self

    def slower(m):
        assert False, "1.2x, not 2x"
    lesson = Claims("04")
    with pytest.raises(AssertionError, match="1.2x"):
        lesson.gated("buckets overlap", slower, Quiet())
    assert lesson.table().loc[1, "verdict"] == "does not hold"


def test_a_cell_run_twice_keeps_one_row_per_claim():
    lesson = Claims("03")
    for _ in range(2):
        lesson.check("the same claim", True, measured=1)
    assert len(lesson.table()) == 1 and "1 checked" in repr(lesson)


def test_make_test_counts_claims_per_lesson_and_gated_ones_apart():
    rows = [Outcome("07: a", "checked", 1, [], 0.0, kind="check"), Outcome("07: b", "failed", 1, [], 0.0, kind="check"),
            Outcome("05: speed", "skipped", 3, [1.0], 0.2, "busy"), Outcome("05: c", "checked", 1, [], 0.0, kind="check"),
            Outcome("untagged", "checked", 1, [], 0.0)]
    assert lesson_lines(rows) == ["lesson 05: 1 checked, 0 failed, 1 not checked",
                                  "lesson 07: 1 checked, 1 failed, 0 not checked",
                                  "lesson other: 1 checked, 0 failed, 0 not checked"]
    assert summary_lines(rows)[0] == "gated claims: 1 checked, 1 skipped"


def test_the_closing_table_shows_each_claim_whole_and_left_aligned():
    lesson = Claims("02")
    claim = "a claim long enough that a plain table would cut it: " + "every word of it matters " * 3
    lesson.check(claim, True, measured="1.0")
    html = lesson.table()._repr_html_()
    assert claim.strip() in html and "text-align: left" in html
