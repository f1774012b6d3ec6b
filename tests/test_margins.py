"""A claim's number against its limit (labkit.measure.bounds), the margins table built from many rounds' claims logs
(tools/margins.py), make test's last lines (tools/run_summary.py), and which lessons run beside the tests."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.measure import Claims, above, below, gated
from labkit.measure.bounds import collecting, worst
from labkit.measure.claims import LOG_ENV, read_log

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import margins  # noqa: E402
import run_summary  # noqa: E402


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "claims.jsonl"
    monkeypatch.setenv(LOG_ENV, str(path))
    return path


def test_a_bound_is_true_on_the_claimed_side_and_its_margin_is_a_fraction_of_the_limit():
    assert below(0.6, 0.75) and not below(0.8, 0.75) and above(15.0, 12.5) and not above(11.0, 12.5)
    assert below(0.6, 0.75).margin == pytest.approx(0.2) and above(15.0, 12.5).margin == pytest.approx(0.2)
    assert above(11.0, 12.5).margin == pytest.approx(-0.12)
    assert below(1e-9, 0.0).margin is None                       # a limit of 0: exact, not a matter of room
    assert str(above(11.0, 12.5, "growth (ms)")) == "growth (ms): 11 is not above 12.5 (margin -12%)"
    with pytest.raises(TypeError, match="reduce a table"):
        below([1.0, 2.0], 3.0)
    with collecting() as made:
        below(1, 2), above(3, 2.9)
    assert [b.op for b in made] == ["<", ">"] and worst(made).value == 3


def test_a_gate_logs_each_bound_and_a_failure_names_the_value_and_the_limit(log):
    def check(m):
        assert above(m, 12.5, "least growth (ms)")
    assert gated("99: ok", check, measure=lambda: 15.0, others=lambda m: 0.0).checked
    with pytest.raises(AssertionError):
        gated("99: thin", check, measure=lambda: 12.0, others=lambda m: 0.0)
    ok, thin = read_log(log)
    assert ok.bounds == [{"what": "least growth (ms)", "value": 15.0, "op": ">", "limit": 12.5, "margin": 0.2}]
    assert thin.status == "failed" and "12 is not above 12.5 (margin -4%)" in thin.reason


def test_a_lesson_claim_given_bounds_keeps_them(log):
    claims = Claims("99")
    claims.check("the gap is small", below(1e-6, 1e-5, "max gap"), measured=1e-6)
    with pytest.raises(AssertionError, match="b: 1 is not above 2"):
        claims.check("both", [below(1, 2, "a"), above(1, 2, "b")])
    small, both = read_log(log)
    assert small.bounds[0]["margin"] == pytest.approx(0.9) and both.status == "failed" and len(both.bounds) == 2


def _round(folder: Path, name: str, rows: list[dict]) -> None:
    with open(folder / name, "w") as f:
        for row in rows:
            f.write(json.dumps({"status": "checked", "attempts": 1, "others": [0.0], "limit": 0.2, "kind": "gated",
                                "reason": "", "measured": "", **row}) + "\n")


def test_the_table_keeps_each_claims_worst_margin_over_the_quiet_rounds(tmp_path):
    bound = lambda v: [{"what": "ratio", "value": v, "op": "<", "limit": 1.0, "margin": 1.0 - v}]  # noqa: E731
    steady = [{"what": "loss", "value": 0.9, "op": "<", "limit": 1.0, "margin": 0.1}]
    for i, v in enumerate((0.5, 0.7, 0.85)):
        _round(tmp_path, f"quiet-{i}.jsonl", [{"claim": "07: thin", "bounds": bound(v)},
                                              {"claim": "07: roomy", "bounds": bound(v / 4)},
                                              {"claim": "07: seeded", "kind": "check", "bounds": steady},
                                              {"claim": "07: exact", "kind": "check"}])
    _round(tmp_path, "busy-0.jsonl", [{"claim": "07: thin", "status": "skipped", "reason": "busy"}])
    rows = {r["claim"]: r for r in margins.table(tmp_path)}
    assert "07: exact" not in rows                       # a check with no number is not a measured claim
    assert rows["07: thin"]["worst_margin"] == pytest.approx(0.15) and margins.verdict(rows["07: thin"]) == "THIN"
    assert margins.verdict(rows["07: roomy"]) == "ok" and rows["07: thin"]["busy"]["skipped"] == 1
    assert margins.verdict(rows["07: seeded"]) == "same every round"
    text = margins.markdown(list(rows.values()), tmp_path)
    assert "| 07: thin | gated | 3/0/0 | 0/0/1 | ratio < 1: 0.5, 0.7, 0.85 | +15% | – | THIN |" in text


def test_a_table_of_a_folder_without_rounds_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        margins.main(["table", str(tmp_path)])
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2 and "no claims logs there" in said and f"run --out {tmp_path}" in said


def test_make_tests_last_lines_say_each_run_the_claims_and_a_failed_claims_measure(tmp_path, monkeypatch):
    def junit(name, tests, failures):
        (tmp_path / f"{name}.xml").write_text(f'<testsuites><testsuite tests="{tests}" failures="{failures}" '
                                              f'errors="0" skipped="1" time="75.5"/></testsuites>')
        (tmp_path / f"{name}.rc").write_text("1\n" if failures else "0\n")
    junit("tests", 10, 0)
    junit("lessons", 3, 1)
    _round(tmp_path, "claims.jsonl", [
        {"claim": "11: one slow rank slows every rank's step", "status": "failed", "reason": "AssertionError",
         "bounds": [{"what": "least growth (ms)", "value": 12.0, "op": ">", "limit": 12.5, "margin": -0.04}]}])
    monkeypatch.setattr(run_summary, "MARGINS", tmp_path / "margins.json")
    (tmp_path / "margins.json").write_text(json.dumps({"11: one slow rank slows every rank's step":
                                                       {"worst_margin": 0.31}}))
    assert run_summary.main([str(tmp_path)]) == 1
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "run_summary.py"), str(tmp_path)],
                         capture_output=True, text=True)
    lines = out.stdout.splitlines()
    assert out.returncode == 1 and lines[-1] == "make test: FAILED"
    assert "tests and the lessons without speed claims: 9 passed, 0 failed, 1 skipped in 1 min 15 s" in lines
    assert "gated claims: 0 checked, 0 skipped, 1 failed" in lines
    assert any("least growth (ms) 12, limit > 12.5" in line for line in lines)


def test_a_lesson_with_a_speed_claim_runs_alone_the_others_beside_the_tests():
    sys.path.insert(0, str(ROOT))
    from conftest import timed_lesson
    lessons = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    timed = {p.name[:2] for p in lessons if timed_lesson(p)}
    assert {"03", "05", "11"} <= timed and not {"00", "01", "08"} & timed
