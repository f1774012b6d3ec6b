"""The classroom's two editions of the lessons, in nbgrader's form:

    python -m labkit.exercises student OUTDIR     # every lesson, each ✏️ cell a stub: no solution anywhere
    python -m labkit.exercises solutions OUTDIR   # the instructor's: each solution in its cell, in nbgrader regions
    write_edition("student", "handout/", lessons=["16_build_ddp_yourself"])   # the same from Python

Both carry nbgrader's cell metadata: each ✏️ cell is a solution cell (`solution`, `grade_id`), the checker cell
after it (the first code cell calling `report.use(...)`) an autograded test cell (`grade`, `locked`, `points`).
In the solutions edition each function body (after its signature and docstring) and each answer line
(`NAME = value  # ✏️`) sits between `### BEGIN SOLUTION` and `### END SOLUTION`, so that nbgrader's
generate_assignment makes the student's copy and its autograde scores it (its stub is `raise
NotImplementedError()`, which the checkers call "not written yet" too). The student edition is labkit's own stubs
(blanks.blank_source, exactly the lessons' ✏️ cells), and the folded solution cells are gone. Run under a grader
(grade mode: `python -m labkit.exercises grade`, or nbgrader's autograde) a stub raises in its checker cell;
run by a learner, a checker says "not written yet" and the lesson goes on with labkit's reference.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .blanks import EXERCISE_MARK, _as_lines, blank_source, is_exercise, region_source, \
    solution_of, split_magic

EDITIONS = ("student", "solutions")
NBGRADER_SCHEMA = 3


@dataclass(frozen=True)
class Exercise:
    """One ✏️ exercise of a notebook: its cell, its checker cell, its folded solution cell (None where absent)."""

    number: int        # 1, 2, ... in the notebook's order
    cell: int          # the ✏️ cell's index
    checker: int       # the checker cell's index (the first code cell after it calling .use()
    solution: int | None
    checkers: tuple[int, ...]   # every checker cell up to the next exercise (an exercise may ask two things)
    title: str         # what the ✏️ cell's first line says after EXERCISE_MARK
    grade_id: str      # nbgrader's id of the ✏️ cell; its checkers' are grade_id + "-check", "-check2", ...


def find_exercises(cells: list[dict]) -> list[Exercise]:
    """The exercises of a notebook's cells, in order (cells marked by EXERCISE_MARK, or by nbgrader's `solution`
    metadata where a copy lost the mark)."""
    found = []
    marked = [i for i, cell in enumerate(cells) if is_exercise(cell) or _nbgrader(cell).get("solution")]
    for number, index in enumerate(marked, 1):
        end = marked[number] if number < len(marked) else len(cells)
        checkers = tuple(i for i in range(index + 1, end) if _is_checker(cells[i]))
        if not checkers:
            raise ValueError(f"cell {index}: no checker cell (one calling report.use(...)) follows this exercise")
        checker = checkers[0]
        after = checker + 1
        solution = after if after < len(cells) and solution_of(cells[after]) is not None else None
        body = split_magic("".join(cells[index].get("source", [])))[1].lstrip()
        first = body.splitlines()[0] if body else ""
        title = first.removeprefix(EXERCISE_MARK).strip(" ·") if first.startswith(EXERCISE_MARK) else ""
        title = re.sub(r"^\d+\s*·\s*", "", title) or f"exercise {number}"
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40]
        found.append(Exercise(number, index, checker, solution, checkers, title, f"ex{number}-{slug}"))
    return found


def _is_checker(cell: dict) -> bool:
    """A code cell handing an exercise to a checker (`report.use(...)`), or one nbgrader's metadata says is a test
    cell (a submission whose checker cell was edited is still graded there, on the lesson's own checker)."""
    return cell.get("cell_type") == "code" and (".use(" in "".join(cell.get("source", []))
                                                or bool(_nbgrader(cell).get("grade")))


def _nbgrader(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def solution_cell_metadata(grade_id: str) -> dict:
    """nbgrader's metadata for a cell the learner writes."""
    return {"grade": False, "grade_id": grade_id, "locked": False, "schema_version": NBGRADER_SCHEMA,
            "solution": True, "task": False}


def test_cell_metadata(grade_id: str, points: float = 1) -> dict:
    """nbgrader's metadata for an autograded test cell (a checker cell: it raises when the exercise fails)."""
    return {"grade": True, "grade_id": grade_id, "locked": True, "points": points,
            "schema_version": NBGRADER_SCHEMA, "solution": False, "task": False}


def edition(notebook: str | Path, kind: str) -> dict:
    """The notebook `notebook` as the `kind` edition ("student" or "solutions"), as nbformat JSON."""
    if kind not in EDITIONS:
        raise ValueError(f"edition {kind!r}: must be one of {EDITIONS}")
    notebook = Path(notebook)
    data = json.loads(notebook.read_text())
    cells = data["cells"]
    drop = []
    for exercise in find_exercises(cells):
        if exercise.solution is None:
            raise ValueError(f"{notebook}: exercise {exercise.number} ({exercise.title}, cell {exercise.cell}) has "
                             "no folded solution after its checker; `python -m labkit.exercises write-first` makes "
                             "one")
        solution = solution_of(cells[exercise.solution]).rstrip("\n")
        source = region_source(solution) if kind == "solutions" else blank_source(solution)
        cell = cells[exercise.cell]
        cell["source"] = _as_lines(source)
        cell.setdefault("metadata", {})["nbgrader"] = solution_cell_metadata(exercise.grade_id)
        for n, index in enumerate(exercise.checkers, 1):
            cells[index].setdefault("metadata", {})["nbgrader"] = test_cell_metadata(
                exercise.grade_id + "-check" + (str(n) if n > 1 else ""))
        drop.append(exercise.solution)
    data["cells"] = [cell for i, cell in enumerate(cells) if i not in set(drop)]
    for cell in data["cells"]:
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    data.setdefault("metadata", {})["labkit"] = {"lesson": notebook.stem, "edition": kind}
    return data


def reads_the_clone(notebook: Path) -> bool:
    """True if the lesson's code reads files of the clone beside its folder (../examples, the pyproject.toml)."""
    code = "".join("".join(c.get("source", [])) for c in json.loads(notebook.read_text())["cells"]
                   if c.get("cell_type") == "code")
    return "../" in code or "pyproject.toml" in code


def lessons_dir() -> Path:
    """The lessons beside the package (a clone installed with `pip install -e .`)."""
    return Path(__file__).resolve().parents[2] / "notebooks"


def write_edition(kind: str, out: str | Path, lessons: list[str] | None = None,
                  source: str | Path | None = None) -> list[Path]:
    """Write the `kind` edition of every lesson in `source` (default: lessons_dir()) to the folder `out`, with the
    files the lessons link to (glossary, course map); `lessons` picks some by number or name ("16", "16_build...").
    A lesson without exercises is copied with its outputs cleared. Returns the notebooks written. Lessons that read
    the clone's files (reads_the_clone: 01, 22) run where `out` is a folder of the clone, as notebooks/ is."""
    source = Path(source) if source is not None else lessons_dir()
    notebooks = sorted(source.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise ValueError(f"{source}: no lessons (NN_name.ipynb) there")
    if lessons:
        wanted = {name.removesuffix(".ipynb") for name in lessons}
        notebooks = [nb for nb in notebooks if nb.stem in wanted or nb.stem[:2] in wanted]
        unknown = wanted - {nb.stem for nb in notebooks} - {nb.stem[:2] for nb in notebooks}
        if unknown:
            raise ValueError(f"no lesson {sorted(unknown)} in {source}")
    out = Path(out)
    if out.resolve() == source.resolve():
        raise ValueError(f"{out} is the lessons' own folder: write an edition somewhere else")
    out.mkdir(parents=True, exist_ok=True)
    for other in source.iterdir():   # what the lessons link to: the glossary, the course map, its data
        if other.is_file() and other.suffix != ".ipynb":
            shutil.copy2(other, out / other.name)
    written = []
    for notebook in notebooks:
        data = json.loads(notebook.read_text())
        if find_exercises(data["cells"]):
            data = edition(notebook, kind)
        else:
            for cell in data["cells"]:
                if cell.get("cell_type") == "code":
                    cell["outputs"], cell["execution_count"] = [], None
        path = out / notebook.name
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        written.append(path)
    return written
