"""The lesson form (issue 27), read off every lesson written in it: a header that says what you will learn, what you
need and how long it takes; the torch API called in a code cell; at least two predict-then-run questions with their
answers folded; one Claims object numbered like the file; the claims' closing table; a recap and further reading
with links; no code cell over 25 lines, no code line over 100 columns (in code cells and in the ```python blocks
of the folded solutions), no lesson over 50 cells (issue 42: the exercises to come add about 3 each).

Lessons not yet in the form are listed in NOT_YET; the list only shrinks (an entry for a lesson that is in the form
fails, so it cannot rot)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LESSONS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if not p.name.endswith(".blank.ipynb"))
NOT_YET: set[str] = set()   # empty since issue 28: every lesson is in the form (22, new in issue 29, was written in it)
MAX_CELL_LINES = 25
MAX_COLUMNS = 100   # a learner reading a lesson at a laptop's width does not scroll sideways
MAX_CELLS = 50
# The torch API a lesson is about, called (not only imported) in a code cell: the same pattern lesson-metrics reads.
API = re.compile(r"\b(dist\.(all_reduce|all_gather|broadcast|reduce_scatter|all_to_all|send|recv|isend|irecv|barrier|"
                 r"init_process_group|new_group|monitored_barrier|get_rank|get_backend|get_world_size)|"
                 r"torch\.distributed|DistributedDataParallel|DDP\(|fully_shard|init_device_mesh|parallelize_module|"
                 r"ColwiseParallel|RowwiseParallel|PipelineStage|Schedule[A-Z0-9]\w+|DistributedSampler|Join\(|"
                 r"all_to_all_single|ZeroRedundancyOptimizer|register_comm_hook|no_sync\(|dcp\.|GradScaler|autocast|"
                 r"clip_grad_norm_|_scaled_mm|context_parallel|DataLoader\(|manual_seed|lr_scheduler)")


def cells(lesson: Path, kind: str) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(lesson.read_text())["cells"] if c["cell_type"] == kind]


def calls(code: str) -> str:
    """A code cell without import lines and comments: an import alone shows no API in use."""
    return "\n".join(line.split("#")[0] for line in code.splitlines() if not re.match(r"\s*(import|from)\s", line))


def form_problems(lesson: Path) -> list[str]:
    """What the lesson lacks of the form, in words (empty: it is in the form)."""
    md, code = cells(lesson, "markdown"), cells(lesson, "code")
    header, text, number = (md[0] if md else ""), "\n\n".join(md), lesson.name[:2]
    problems = []
    for need, pattern in [("You will learn", r"you will learn"), ("You need", r"you need"),
                          ("Run time (quick and full)", r"\brun time\b.{0,80}quick.{0,80}full"),
                          ("The folklore", r"folklore")]:
        if not re.search(pattern, header, re.I | re.S):
            problems.append(f"the header (first cell) lacks '{need}'")
    if not re.search(r"^#+\s*Recap\b", text, re.M):
        problems.append("no '## Recap'")
    if not re.search(r"^#+\s*Further reading\b", text, re.M) or len(re.findall(r"\]\(https?://", text)) < 2:
        problems.append("no '## Further reading' with at least 2 links")
    predicts = sum(bool(re.search(r"\*\*Predict\.?\*\*", m)) for m in md)
    answers = sum("<details>" in m for m in md)
    if predicts < 2 or answers < predicts:
        problems.append(f"{predicts} '**Predict.**' questions and {answers} folded answers (need >= 2, each answered)")
    if not any(API.search(calls(c)) for c in code):
        problems.append("no code cell calls the torch API the lesson is about")
    if not any(re.search(rf"Claims\(\s*['\"]{number}['\"]\s*\)", c) for c in code):
        problems.append(f"no Claims({number!r})")
    if not any(re.search(r"\.table\(\)", c) for c in code):
        problems.append("no closing claims.table()")
    long = [sum(1 for line in c.splitlines() if line.strip()) for c in code]
    if long and max(long) > MAX_CELL_LINES:
        problems.append(f"a code cell of {max(long)} lines (at most {MAX_CELL_LINES})")
    wide = wide_lines(lesson)
    if wide:
        problems.append(f"{len(wide)} code lines over {MAX_COLUMNS} columns (the first: {wide[0]})")
    count = len(json.loads(lesson.read_text())["cells"])
    if count > MAX_CELLS:
        problems.append(f"{count} cells (at most {MAX_CELLS})")
    return problems


def wide_lines(lesson: Path) -> list[str]:
    """Code lines over MAX_COLUMNS, each as 'cell N: <its start>': in code cells and in the ```python blocks of
    markdown cells (the folded solutions are code a learner reads too)."""
    found = []
    for n, cell in enumerate(json.loads(lesson.read_text())["cells"]):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            text = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
        elif cell["cell_type"] != "code":
            continue
        found += [f"cell {n}: {line[:40]}..." for line in text.splitlines() if len(line) > MAX_COLUMNS]
    return found


@pytest.mark.parametrize("lesson", [p for p in LESSONS if p.name[:2] not in NOT_YET], ids=lambda p: p.stem)
def test_the_lesson_is_in_the_form(lesson):
    problems = form_problems(lesson)
    assert not problems, f"{lesson.name}: " + "; ".join(problems)


def test_ruff_reads_every_lesson_and_finds_no_line_over_100_columns_and_no_syntax_error():
    """ruff (the test extra) parses each code cell as Python, magics included: E9 is a syntax error, E501 a line
    over 100 columns."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
    done = subprocess.run([ruff, "check", "--isolated", "--no-cache", "--select", "E501,E9", "--line-length",
                           str(MAX_COLUMNS), "--output-format", "concise", *map(str, LESSONS)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_the_list_of_lessons_not_yet_in_the_form_only_shrinks():
    done = [p.name for p in LESSONS if p.name[:2] in NOT_YET and not form_problems(p)]
    assert not done, f"in the form now, so remove them from NOT_YET: {done}"


def test_a_lesson_out_of_form_is_named_for_what_it_lacks(tmp_path):
    planted = tmp_path / "07_planted.ipynb"
    planted.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": "# 07 · A lesson\n**You will learn**\n- x", "metadata": {}},
        {"cell_type": "code", "source": "claims = labkit.Claims('07')\n" + "x = 1\n" * 30, "metadata": {}}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    problems = form_problems(planted)
    assert "the header (first cell) lacks 'You need'" in problems and "no '## Recap'" in problems
    assert "no code cell calls the torch API the lesson is about" in problems
    assert "a code cell of 31 lines (at most 25)" in problems and "no Claims('07')" not in problems
    assert not any("columns" in p or "cells (at most" in p for p in problems)
    wide, folded = "total = " + " + ".join(["1"] * 40), "<details>\n\n```python\nx = '" + "a" * 95 + "'\n```"
    planted.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": "# 07 · A lesson", "metadata": {}},
        {"cell_type": "code", "source": wide, "metadata": {}},
        {"cell_type": "markdown", "source": folded, "metadata": {}}]
        + [{"cell_type": "markdown", "source": "more", "metadata": {}}] * 48,
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    problems = form_problems(planted)
    assert f"2 code lines over 100 columns (the first: cell 1: {wide[:40]}...)" in problems, problems
    assert "51 cells (at most 50)" in problems


# --- no claim dropped (tests/claims_floor.json, enforced by conftest at the end of make test) ----------------------

def test_each_floor_is_the_asserts_before_less_the_ones_removed_with_a_reason_or_what_it_logs_now():
    data = json.loads((Path(__file__).parent / "claims_floor.json").read_text())
    raised = data["raised"]["counts"]
    split = data.get("split", {"from": {}, "into": {}})
    parts = {part for into in split["into"].values() for part in into}
    for parent, into in split["into"].items():   # a split lesson's claims all went to its parts
        assert sum(data["floor"][p] for p in into) >= split["from"][parent], (
            f"lessons {' + '.join(into)} hold {sum(data['floor'][p] for p in into)} claims, fewer than lesson "
            f"{parent}'s {split['from'][parent]} before the split")
    for lesson, floor in data["floor"].items():
        if lesson in parts:
            continue
        removed = data["removed"].get(lesson, [])
        assert all(isinstance(r, str) and len(r) > 20 for r in removed), f"lesson {lesson}: say why each went"
        expected = max(data["before"][lesson] - len(removed), raised.get(lesson, 0))
        assert floor == expected, f"lesson {lesson}: floor {floor}, expected {expected}"
    in_form = {p.name[:2] for p in LESSONS if p.name[:2] not in NOT_YET}
    assert in_form <= set(data["floor"]), f"lessons in the form without a floor: {sorted(in_form - set(data['floor']))}"


def test_a_lesson_below_its_floor_is_named():
    from labkit.measure.claims import Outcome
    from conftest import claims_below_floor   # the root conftest.py, make test's hooks
    data = json.loads((Path(__file__).parent / "claims_floor.json").read_text())
    lesson = next(iter(data["floor"]), None)
    if lesson is None:
        pytest.skip("no lesson has a floor yet")
    few = [Outcome(f"{lesson}: claim {i}", "checked", 1, [], 0.0, kind="check")
           for i in range(data["floor"][lesson] - 1)]
    assert claims_below_floor(few) == [f"lesson {lesson}: {len(few)} claims logged, fewer than its floor of "
                                       f"{data['floor'][lesson]} (tests/claims_floor.json)"]
    assert claims_below_floor(few + [Outcome(f"{lesson}: one more", "skipped", 0, [], 0.0)]) == []


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.name[:2])
def test_every_cell_has_its_own_id(lesson):
    """nbformat 4.5 gives each cell an id (JupyterLab and nbconvert key on it); a cell without one makes nbformat warn
    on every run today and will be an error in a later nbformat (lesson 15's had none)."""
    cells = json.loads(lesson.read_text())["cells"]
    ids = [c.get("id") for c in cells]
    assert None not in ids, f"{lesson.name}: cells {[i for i, x in enumerate(ids) if x is None]} have no id"
    assert len(set(ids)) == len(ids), f"{lesson.name}: repeated cell ids"
