"""The last lines of `make test`: both of its pytest runs, the lessons' claims, and one verdict.

    python tools/run_summary.py $(TEST_RUNS)      # reads tests.xml/.rc, lessons.xml/.rc, claims.jsonl there

`make test` runs pytest twice: the tests and the lessons that make no speed claim (two at a time, pytest-xdist:
most of them wait on ranks, timeouts and hangs), then the lessons with speed claims (one at a time: a speed claim
is checked only on cores nothing else used). Each run leaves a JUnit XML file (tests.xml, lessons.xml) and its exit
status (tests.rc, lessons.rc) in the folder; the claims are logged to claims.jsonl. This prints:

    tests and the lessons without speed claims: 1201 passed, 0 failed, 2 skipped in 6 min 40 s
    the lessons with speed claims: 15 passed, 0 failed, 0 skipped in 9 min 02 s
    gated claims: 67 checked, 1 skipped, 0 failed
    claims: 24 lessons logged 612 claims, 0 failed, 0 lessons under their floor
    make test: PASSED

and for a claim that failed, its measured value against its limit and the worst margin tests/margins.json (made by
tools/margins.py) saw for it, so that a new failure is told apart from a claim that was always close. The exit
status is 1 when either run failed (or left no result), else 0.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.measure.claims import Outcome, floor_lines, lesson_counts, read_log, summary_lines  # noqa: E402

MARGINS = ROOT / "tests" / "margins.json"
FLOORS = ROOT / "tests" / "claims_floor.json"
PHASES = (("tests", "tests and the lessons without speed claims"), ("lessons", "the lessons with speed claims"))


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def phase_line(folder: Path, name: str, title: str) -> tuple[str, bool]:
    """One pytest run in one line, and whether it passed; a run that left no result failed."""
    xml, rc = folder / f"{name}.xml", folder / f"{name}.rc"
    status = int(rc.read_text().strip() or 1) if rc.exists() else None
    if not xml.exists():
        return f"{title}: no result (pytest left no {xml.name}; exit status {status})", False
    suites = ET.parse(xml).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    took = max((float(s.get("time", 0)) for s in suites), default=0.0)
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    failed = count["failures"] + count["errors"]
    line = f"{title}: {passed} passed, {failed} failed, {count['skipped']} skipped in {minutes(took)}"
    if status not in (0, None) and not failed:
        line += f" (pytest exited {status})"
    ok = status == 0 and not failed
    return line, ok


def failed_claims(outcomes: list[Outcome], table: dict[str, Any]) -> list[str]:
    """Each failed claim: what it measured against its limit, and the margins table's worst for it."""
    lines = []
    for o in outcomes:
        if o.status != "failed":
            continue
        missed = [b for b in o.bounds if b.get("margin") is not None and b["margin"] <= 0] or o.bounds
        said = "; ".join(f"{b.get('what') or 'value'} {b['value']:.4g}, limit {b['op']} {b['limit']:.4g}"
                         for b in missed) or (o.reason or o.measured or "no number recorded")
        seen = table.get(o.claim, {}).get("worst_margin")
        before = (f"worst margin in tests/margins.md: {seen:+.0%}" if seen is not None
                  else "not in tests/margins.md" if o.claim not in table else "tests/margins.md has no number for it")
        lines.append(f"  FAILED {o.claim}: measured {said}; {before}")
    return lines


def claims_lines(outcomes: list[Outcome]) -> list[str]:
    """The lessons' claims in two lines (checked, failed; lessons under their floor), and the gated claims'."""
    counts = lesson_counts(outcomes)
    counts.pop("other", None)
    short = ["  " + line for line in floor_lines(outcomes, json.loads(FLOORS.read_text())["floor"])]
    total = sum(sum(by.values()) for by in counts.values())
    failed = sum(by["failed"] for by in counts.values())
    head = (f"claims: {len(counts)} lessons logged {total} claims, {failed} failed, "
            f"{len(short)} lesson{'s' * (len(short) != 1)} under its floor (tests/claims_floor.json)")
    return summary_lines(outcomes) + [head] + short


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[0] + "\nusage: python tools/run_summary.py TEST_RUNS_FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    lines, ok = [], True
    for name, title in PHASES:
        line, passed = phase_line(folder, name, title)
        lines.append(line)
        ok &= passed
    outcomes = read_log(folder / "claims.jsonl")
    table = json.loads(MARGINS.read_text()) if MARGINS.exists() else {}
    lines += claims_lines(outcomes)
    lines += failed_claims(outcomes, table)
    print("\n" + "=" * 30 + " make test: summary " + "=" * 30)
    print("\n".join(lines))
    print(f"make test: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
