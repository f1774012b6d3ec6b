"""The classroom: the student and solutions editions in nbgrader's form, grade mode, and the grader.

The student edition must hold no solution (each solution's body searched for), keep every other cell as the
lesson has it, and carry nbgrader's metadata; the solutions edition holds each solution in nbgrader's regions.
The grader runs real submissions: a planted one (one mistake per exercise, a deadlock among them) gets each
verdict and the checker's reason; one that loops, one that kills its kernel and one that ignores interrupts are
rows that say so, and nothing they started is left running.
"""
import json
import time
from pathlib import Path

import pytest

from labkit.exercises import blanks, editions, grading
from labkit.exercises.report import ExerciseFailed, Report

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LESSONS = [nb for nb in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
           if editions.find_exercises(json.loads(nb.read_text())["cells"])]


def _code(cells):
    return "\n".join("".join(c["source"]) for c in cells)


def _regions(source: str) -> list[str]:
    """The text between nbgrader's markers, each region dedented and joined."""
    out, inside = [], None
    for line in source.split("\n"):
        if line.strip() == blanks.BEGIN_SOLUTION:
            inside = []
        elif line.strip() == blanks.END_SOLUTION:
            out.append("\n".join(part.strip() for part in inside if part.strip()))
            inside = None
        elif inside is not None:
            inside.append(line)
    return out


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem[:2])
def test_student_edition_holds_no_solution(lesson, tmp_path):
    original = json.loads(lesson.read_text())
    student = editions.edition(lesson, "student")
    solutions = editions.edition(lesson, "solutions")
    exercises = editions.find_exercises(original["cells"])
    text = json.dumps(student, ensure_ascii=False)
    student_code = "\n".join(line.strip() for line in _code(student["cells"]).split("\n"))
    regions = [region for e in exercises for region in _regions("".join(solutions["cells"][
        e.cell - sum(x.solution < e.cell for x in exercises)]["source"]))]
    assert regions, f"{lesson.name}: no solution region in the solutions edition"
    for region in regions:
        assert region not in student_code, f"{lesson.name}: a solution is in the student edition:\n{region}"
    assert blanks.SOLUTION_MARK not in text and blanks.BEGIN_SOLUTION not in text
    # every cell but the folded solutions is the lesson's: the stubs are the lesson's own
    kept = [c for i, c in enumerate(original["cells"]) if i not in {e.solution for e in exercises}]
    assert [c["source"] for c in kept] == [c["source"] for c in student["cells"]]
    assert [c["source"] for c in kept if c["cell_type"] == "markdown"] == \
        [c["source"] for c in solutions["cells"] if c["cell_type"] == "markdown"]
    # nbgrader's metadata: each ✏️ cell a solution cell, each checker a locked test cell with points; ids unique
    marked = [c["metadata"]["nbgrader"] for c in student["cells"] if "nbgrader" in c.get("metadata", {})]
    ids = [m["grade_id"] for m in marked]
    assert len(ids) == len(set(ids))
    assert sum(m["solution"] for m in marked) == len(exercises)
    assert sum(m["grade"] and m["locked"] and m["points"] > 0 for m in marked) == \
        sum(len(e.checkers) for e in exercises)
    # the solutions edition's ✏️ cells, markers taken out, are the folded solutions
    for exercise, cell in zip(exercises, [c for c in solutions["cells"]
                                          if c.get("metadata", {}).get("nbgrader", {}).get("solution")]):
        source = "".join(cell["source"])
        unmarked = "\n".join(line for line in source.split("\n")
                             if line.strip() not in (blanks.BEGIN_SOLUTION, blanks.END_SOLUTION))
        assert unmarked == blanks.solution_of(original["cells"][exercise.solution]).rstrip("\n")
        assert blanks.blank_source(unmarked) == "".join(original["cells"][exercise.cell]["source"])


def test_write_edition_cli(tmp_path, capsys):
    from labkit.exercises.__main__ import main

    assert main(["student", str(tmp_path / "s"), "--lessons", "24", "03"]) == 0
    assert "2 lessons" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "s").glob("*.ipynb")) == ["03_batch_size_and_scaling.ipynb",
                                                                      "24_first_principles.ipynb"]
    assert (tmp_path / "s" / "GLOSSARY.md").exists()
    for argv, said in ((["student", str(tmp_path / "x"), "--lessons", "99"], "no lesson ['99']"),
                       (["solutions", str(NOTEBOOKS)], "lessons' own folder"),
                       (["grade", str(tmp_path / "nobody.ipynb")], "no such notebook"),
                       (["grade", str(tmp_path / "s" / "24_first_principles.ipynb"), "--cell-timeout", "0"],
                        "must be > 0")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and said in capsys.readouterr().err, argv


def test_grade_mode_raises_for_a_stub_and_hands_the_reference_on(monkeypatch):
    report = Report("your thing")
    report.add("written", "missing", "thing is not written yet")
    assert report.use("reference") == "reference"            # a learner: the lesson goes on
    monkeypatch.setenv("LABKIT_EXERCISES", "grade")
    namespace = {"report": report}
    source = "THING = report.use('reference')\n"
    filename = "<graded cell>"
    import linecache
    linecache.cache[filename] = (len(source), None, [source], filename)
    with pytest.raises(ExerciseFailed, match="NOT WRITTEN YET"):
        exec(compile(source, filename, "exec"), namespace)
    assert namespace["THING"] == "reference"                 # graded: it raised, and the lesson still goes on
    monkeypatch.setenv("LABKIT_EXERCISES", "blank")
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")    # nbgrader's autograde grades too, over blank mode
    with pytest.raises(ExerciseFailed):
        report.use("reference")


def _submission(path: Path, cells: list[tuple[str, str]], lesson: str | None = None) -> Path:
    data = {"cells": [{"cell_type": kind, "id": f"c{i}", "metadata": {}, "source": source,
                       **({"outputs": [], "execution_count": None} if kind == "code" else {})}
                      for i, (kind, source) in enumerate(cells)],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                         **({"labkit": {"lesson": lesson}} if lesson else {})},
            "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(data))
    return path


def _tagged_left(tag_prefix: str = "") -> list[str]:
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and grading.TAG_ENV.encode() in (proc / "environ").read_bytes():
                left.append(proc.name)
        except OSError:
            continue
    return left


def test_grade_a_planted_lesson_submission(tmp_path):
    """Lesson 24's student edition with one mistake per exercise: the stub left, a swap whose sends come first (a
    deadlock), a ring that sums, RING_SENT = n - 1; and the swap's checker cell edited away (restored)."""
    data = editions.edition(NOTEBOOKS / "24_first_principles.ipynb", "student")
    found = editions.find_exercises(data["cells"])
    swap, ring = data["cells"][found[1].cell], data["cells"][found[2].cell]
    swap["source"] = ("def my_swap(tensor, wire):\n    got = torch.empty_like(tensor)\n"
                      "    wire.send(tensor, 1 - wire.rank)\n    wire.recv(got, 1 - wire.rank)\n    return got\n")
    ring["source"] = ("RING_SENT = 3.0  # ✏️\n\n\ndef my_all_reduce(tensor, wire):\n"
                      "    total = tensor.clone()\n    for peer in range(wire.world):\n"
                      "        if peer != wire.rank:\n            got = torch.empty_like(tensor)\n"
                      "            if wire.rank < peer:\n                wire.send(tensor, peer)\n"
                      "                wire.recv(got, peer)\n            else:\n"
                      "                wire.recv(got, peer)\n                wire.send(tensor, peer)\n"
                      "            total += got\n    tensor.copy_(total)\n")
    data["cells"][found[1].checker]["source"] = "pass  # no checking here"
    path = tmp_path / "submitted" / "carol" / "ps24" / "24_first_principles.ipynb"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    start = time.monotonic()
    rows = grading.grade([path], csv_path=tmp_path / "grades.csv", cell_timeout=120)
    took = time.monotonic() - start
    got = {row.exercise: row for row in rows}
    assert {row.learner for row in rows} == {"carol"} and {row.notebook for row in rows} == \
        {"24_first_principles"}
    assert got["your first torchrun script"].status == "not written"
    assert got["a swap that cannot deadlock"].status == "failed"
    assert "send" in got["a swap that cannot deadlock"].reason          # the deadlock, named by the checker
    assert got["the ring all-reduce (1)"].status == "failed"
    assert "sum" in got["the ring all-reduce (1)"].reason.lower()
    assert got["the ring all-reduce (2)"].status == "failed" and "n - 1" in got["the ring all-reduce (2)"].reason
    lines = (tmp_path / "grades.csv").read_text().splitlines()
    assert lines[0] == "learner,notebook,exercise,status,reason,seconds,grade_id" and len(lines) == 5
    assert took < 150 and not _tagged_left()


def test_grade_survives_loops_dead_kernels_and_deaf_kernels(tmp_path):
    check = "report = ex.check_number({name}, 'x', formula=2.0)\nprint(report)\n{name} = report.use(2.0)"
    cells = [("code", "from labkit import exercises as ex"),
             ("code", "# ✏️ EXERCISE 1 · a number\nA = 2.0  # ✏️"), ("code", check.format(name="A")),
             ("code", "# ✏️ EXERCISE 2 · a loop\nimport time\nwhile True:\n    time.sleep(0.1)\nB = 2.0  # ✏️"),
             ("code", check.format(name="B")),
             ("code", "# ✏️ EXERCISE 3 · a crash\nimport os\nos._exit(3)\nC = 2.0  # ✏️"),
             ("code", check.format(name="C"))]
    looping = _submission(tmp_path / "dave.ipynb", cells)
    deaf = _submission(tmp_path / "erin.ipynb", [
        ("code", "# ✏️ EXERCISE 1 · deaf\nimport signal, subprocess, sys, time\n"
                 "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                 "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                 "time.sleep(600)\nA = 2.0  # ✏️"), ("code", check.format(name="A"))])
    # a cell may take 6 s (the import before the first exercise gets 120); a submission 150 s, the deaf one 25 s.
    # Margins for a loaded machine: 4 s and 12 s failed once with 8 gloo ranks training beside this test
    rows = grading.grade([looping], cell_timeout=6, notebook_timeout=150)
    rows += grading.grade([deaf], cell_timeout=3, notebook_timeout=25)
    got = {(row.learner, row.exercise): row for row in rows}
    assert got["dave", "a number"].status == "passed"
    assert got["dave", "a loop"].status == "timed out" and "6 s" in got["dave", "a loop"].reason
    assert got["dave", "a crash"].status == "not run" and "Dead" in got["dave", "a crash"].reason
    assert got["erin", "deaf"].status in ("not run", "timed out")
    assert not _tagged_left()
    table = grading.table(rows)
    assert "dave" in table and "1/3" in table and "0/1" in table
