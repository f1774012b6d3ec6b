"""nbgrader itself on a labkit lesson: generate_assignment on the solutions edition gives the student copy, autograde
scores two learners, and each test cell's score is the verdict `python -m labkit.exercises grade` gives.

nbgrader is an optional extra (it brings notebook 7 and a database): `make test-classroom` installs it in a venv of
its own and runs this file; without it, the test is skipped.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

nbgrader = pytest.importorskip("nbgrader")

from labkit.exercises import editions, grading  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LESSON = "24_first_principles"
STUB = "# YOUR CODE HERE\nraise NotImplementedError()"


def _nbgrader(course: Path, *args: str) -> str:
    bin_dir = str(Path(sys.executable).parent)   # nbgrader runs `alembic` from PATH when it makes its database
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), LABKIT_QUICK="1",
               LABKIT_RUNS=str(course / "runs"), MPLBACKEND="Agg")
    env.pop("LABKIT_EXERCISES", None)
    done = subprocess.run([str(Path(bin_dir) / "nbgrader"), *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _fill(cell: dict, solution: str) -> None:
    """Put a solution in nbgrader's student cell: each stub replaced by what the region held, in order."""
    source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    lines, inside, regions = solution.split("\n"), False, []
    for line in lines:
        if line.strip() == "### BEGIN SOLUTION":
            inside, regions = True, regions + [[]]
        elif line.strip() == "### END SOLUTION":
            inside = False
        elif inside:
            regions[-1].append(line)
    for region in regions:
        indent = region[0][:len(region[0]) - len(region[0].lstrip())]
        stub = indent + STUB.replace("\n", "\n" + indent)
        assert stub in source, source
        source = source.replace(stub, "\n".join(region), 1)
    cell["source"] = source


def test_nbgrader_generate_and_autograde_agree_with_grade(tmp_path):
    course = tmp_path / "course"
    source = course / "source" / "l24"
    source.mkdir(parents=True)
    editions.write_edition("solutions", source, lessons=[LESSON])
    for extra in source.iterdir():   # the lesson alone: nbgrader releases every file of the folder
        if extra.suffix != ".ipynb" or extra.stem != LESSON:
            extra.unlink()
    (course / "nbgrader_config.py").write_text(
        f"c = get_config()\nc.CourseDirectory.root = {str(course)!r}\nc.CourseDirectory.course_id = 'labkit'\n"
        "c.Execute.timeout = 300\n")
    _nbgrader(course, "generate_assignment", "l24", "--force")
    release = json.loads((course / "release" / "l24" / f"{LESSON}.ipynb").read_text())
    solutions = json.loads((source / f"{LESSON}.ipynb").read_text())
    by_id = {c["metadata"]["nbgrader"]["grade_id"]: c for c in solutions["cells"]
             if c.get("metadata", {}).get("nbgrader", {}).get("solution")}
    student_cells = [c for c in release["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    assert len(student_cells) == len(by_id) == 3
    text = json.dumps(release)
    assert "### BEGIN SOLUTION" not in text and "RING_SENT = 2 * (4 - 1) / 4" not in text

    def submit(student: str, edit) -> Path:
        data = json.loads(json.dumps(release))
        edit(data)
        folder = course / "submitted" / student / "l24"
        folder.mkdir(parents=True)
        path = folder / f"{LESSON}.ipynb"
        path.write_text(json.dumps(data))
        return path

    def solved(data):
        for cell in data["cells"]:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if meta.get("solution"):
                _fill(cell, "".join(by_id[meta["grade_id"]]["source"]))

    def planted(data):   # the script left as nbgrader's stub; RING_SENT = n - 1; a ring that sums
        for cell in data["cells"]:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if meta.get("grade_id", "").startswith("ex3-") and meta.get("solution"):
                _fill(cell, "".join(by_id[meta["grade_id"]]["source"]))
                cell["source"] = cell["source"].replace("RING_SENT = 2 * (4 - 1) / 4", "RING_SENT = 3.0") \
                    .replace("tensor.div_(world)", "pass")
            elif meta.get("grade_id", "").startswith("ex2-") and meta.get("solution"):
                _fill(cell, "".join(by_id[meta["grade_id"]]["source"]))

    submissions = [submit("alice", solved), submit("bob", planted)]
    _nbgrader(course, "autograde", "l24", "--force")
    from nbgrader.api import Gradebook
    scores = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="labkit") as book:
        for student in ("alice", "bob"):
            for grade in book.find_submission_notebook(LESSON, "l24", student).grades:
                scores[student, grade.name] = grade.auto_score == grade.max_score
    rows = grading.grade(submissions, cell_timeout=300)
    ours = {(row.learner, row.grade_id): row.status == "passed" for row in rows}
    assert ours == scores, (ours, scores, [r for r in rows if r.status != "passed"])
    assert all(ours["alice", gid] for (who, gid) in ours if who == "alice")
    assert [ours["bob", gid] for gid in sorted(g for w, g in ours if w == "bob")] == [False, True, False, False]
    shutil.rmtree(course / "runs", ignore_errors=True)
