"""Write first, then read the answer: the ✏️ exercise cells of a lesson ship as stubs, each answer folded below its
checker; and the copies that tests and learners need.

    write_first("notebooks/16_build_ddp_yourself.ipynb")   # ✏️ cells to stubs, solutions folded after checkers
    solved_copy("notebooks/16_build_ddp_yourself.ipynb", "/tmp/16.solved.ipynb")   # the solutions put back (CI runs it)
    blank_copy("notebooks/16_build_ddp_yourself.ipynb")   # -> 16_build_ddp_yourself.blank.ipynb, in blank mode
    python -m labkit.exercises blank|solved|write-first NOTEBOOK [--out PATH]     # the same, from a terminal

A lesson's ✏️ cell holds the learner's stub; the first code cell after it that hands the stub to a checker
(`report.use(reference)`) is followed by a markdown cell holding the solution in a folded <details> block, marked
SOLUTION_MARK: it does not run, so nothing overwrites what the learner wrote, and it opens with one click. A stub
that is not written yet is reported as such by its checker, and the lesson carries on with labkit's reference.

In the copy, every function and method defined in a cell that starts with EXERCISE_MARK keeps its signature and
docstring, and its body becomes `raise NotImplementedError("<name> is not written yet")`; an answer that is a number
or a name is a top-level line `NAME = value  # ✏️ ...`, which becomes `NAME = ...  # ✏️ ...` (answers.py judges
it); a script the learner writes is a cell starting with `%%writefile path`, EXERCISE_MARK on its second line. A first cell sets
LABKIT_EXERCISES=blank, so each checker reports what is still missing instead of stopping the notebook, and the
cells after it go on with labkit's reference until yours passes. Everything else in the notebook is unchanged.
"""
from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from .answers import ANSWER_MARK
from .report import MODE_ENV

EXERCISE_MARK = "# ✏️ EXERCISE"
MODE_CELL = (f"# A blank copy made by labkit.exercises.blank_copy: the ✏️ cells are yours to fill in.\n"
             f"# Checkers say what is missing; until yours passes, the cells below use labkit's reference.\n"
             f"import os\nos.environ.setdefault({MODE_ENV!r}, \"blank\")   # a grader's mode wins")


def blank_source(source: str) -> str:
    """`source` with every function body (methods included) replaced by a NotImplementedError naming it, and every
    top-level answer line (`NAME = value  # ✏️ ...`) by `NAME = ...  # ✏️ ...`. A cell magic on the first line
    (`%%writefile train.py`: a script the learner writes) is kept, and the script below it blanked."""
    magic, body = split_magic(source)
    if magic:
        return magic + "\n" + blank_source(body)
    lines = source.split("\n")
    for first, last, replacement, _ in sorted(_solution_spans(source), reverse=True):
        lines[first:last + 1] = [replacement]
    return "\n".join(lines)


BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"   # nbgrader's markers


def region_source(source: str) -> str:
    """`source` with what blank_source would empty wrapped in nbgrader's solution markers, at the indentation of
    what they hold: inside each function body (its signature and docstring stay outside), around each answer line.
    nbgrader's generate_assignment replaces each region with its stub; blank_source(source) is labkit's stub."""
    magic, body = split_magic(source)
    if magic:
        return magic + "\n" + region_source(body)
    lines = source.split("\n")
    for first, last, _, indent in sorted(_solution_spans(source), reverse=True):
        if last >= first:   # an insertion (a body that is only a docstring) holds no solution to mark
            lines[first:last + 1] = [indent + BEGIN_SOLUTION, *lines[first:last + 1], indent + END_SOLUTION]
    return "\n".join(lines)


def _solution_spans(source: str) -> list[tuple[int, int, str, str]]:
    """(first line index, last line index, the stub's replacement, indentation) of each part of `source` that is
    the learner's to write: each function body after its docstring, each top-level answer line."""
    lines = source.split("\n")
    edits: list[tuple[int, int, str, str]] = []
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) and node.value is not None else None
        last = lines[node.end_lineno - 1] if target is not None else ""
        if isinstance(target, ast.Name) and ANSWER_MARK in last:
            note = last[last.index(ANSWER_MARK):]
            typed = f": {ast.unparse(node.annotation)}" if isinstance(node, ast.AnnAssign) else ""
            edits.append((node.lineno - 1, node.end_lineno - 1, f"{ast.unparse(target)}{typed} = ...  {note}", ""))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                documented = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                                          ast.Constant) \
                    and isinstance(body[0].value.value, str)
                rest = body[1:] if documented else body
                if rest and rest[0].lineno == child.lineno:
                    continue  # a one-line def: nothing to empty without rewriting the line
                indent = " " * body[0].col_offset
                raise_line = indent + f'raise NotImplementedError("{prefix}{child.name} is not written yet")'
                if len(raise_line) > 100:   # the lessons' code stays within 100 columns
                    raise_line = (indent + "raise NotImplementedError(\n" + indent + "    "
                                  + f'"{prefix}{child.name} is not written yet")')
                if rest:
                    # a comment line just above the first statement belongs to the body too
                    first = rest[0].lineno - 1
                    while first - 1 >= body[0].end_lineno and lines[first - 1].strip().startswith("#"):
                        first -= 1
                    edits.append((first, child.end_lineno - 1, raise_line, indent))
                else:
                    edits.append((child.end_lineno, child.end_lineno - 1, raise_line, indent))

    visit(ast.parse(source), "")
    return edits


def split_magic(source: str) -> tuple[str, str]:
    """(the cell magic line, the code below it) of a cell that starts with one (`%%writefile train.py`), else
    ("", source): the code is what ast, a checker and ruff read."""
    if source.startswith("%%"):
        magic, _, body = source.partition("\n")
        return magic, body
    return "", source


def is_exercise(cell: dict) -> bool:
    """A code cell whose first line is EXERCISE_MARK, or whose first line is a cell magic (a %%writefile script:
    the magic must come first) and second line EXERCISE_MARK."""
    if cell.get("cell_type") != "code":
        return False
    magic, body = split_magic("".join(cell.get("source", [])))
    return body.lstrip().startswith(EXERCISE_MARK) if magic.startswith("%%writefile") else \
        "".join(cell.get("source", [])).lstrip().startswith(EXERCISE_MARK)


def blank_copy(notebook: str | Path, out: str | Path | None = None) -> Path:
    """Write the blank copy of `notebook` (default: next to it, <name>.blank.ipynb) and return its path."""
    notebook = Path(notebook)
    data = json.loads(notebook.read_text())
    blanked = 0
    for cell in data["cells"]:
        if is_exercise(cell):
            cell["source"] = _as_lines(blank_source("".join(cell["source"])))
            blanked += 1
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    if not blanked:
        raise ValueError(f"{notebook} has no exercise cells (code cells starting with {EXERCISE_MARK!r}): "
                         "nothing to blank")
    data["cells"].insert(0, {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                             "source": _as_lines(MODE_CELL)})
    out = Path(out) if out is not None else notebook.with_suffix(".blank.ipynb")
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return out


def _as_lines(text: str) -> list[str]:
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


SOLUTION_MARK = "<!-- labkit: the solution of the exercise above -->"
FENCE = "```"


def solution_cell(source: str) -> dict:
    """The folded markdown cell that holds an exercise's solution."""
    title = split_magic(source)[1].splitlines()[0].removeprefix(EXERCISE_MARK).strip(" ·")
    text = (f"<details><summary>✅ The solution{': ' + title if title else ''} (open it once yours has been checked, "
            f"or when stuck)</summary>\n{SOLUTION_MARK}\n\n{FENCE}python\n{source.rstrip()}\n{FENCE}\n</details>")
    return {"cell_type": "markdown", "id": hashlib.sha1(source.encode()).hexdigest()[:8], "metadata": {},
            "source": _as_lines(text)}


def solution_of(cell: dict) -> str | None:
    """The solution's code in a cell made by solution_cell, else None."""
    text = "".join(cell.get("source", []))
    if cell.get("cell_type") != "markdown" or SOLUTION_MARK not in text:
        return None
    body = text.split(f"{FENCE}python\n", 1)[1]
    return body.rsplit(f"\n{FENCE}", 1)[0] + "\n"


def _checker_after(cells: list[dict], start: int) -> int:
    for index in range(start + 1, len(cells)):
        if cells[index].get("cell_type") == "code" and ".use(" in "".join(cells[index]["source"]):
            return index
    raise ValueError(f"cell {start}: no checker cell (one calling report.use(...)) follows this exercise")


def write_first(notebook: str | Path, out: str | Path | None = None) -> Path:
    """Turn each solved ✏️ cell of `notebook` into a stub, its solution folded after its checker (in place by
    default). A notebook already written this way is left as it is."""
    notebook = Path(notebook)
    data = json.loads(notebook.read_text())
    cells = data["cells"]
    for index in [i for i, cell in enumerate(cells) if is_exercise(cell)][::-1]:
        checker = _checker_after(cells, index)
        if checker + 1 < len(cells) and solution_of(cells[checker + 1]) is not None:
            continue
        source = "".join(cells[index]["source"])
        cells[index]["source"] = _as_lines(blank_source(source))
        cells.insert(checker + 1, solution_cell(source))
    out = Path(out) if out is not None else notebook
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return out


def solved_copy(notebook: str | Path, out: str | Path) -> Path:
    """A copy of `notebook` whose ✏️ cells hold their folded solutions: the lesson as one who solved it runs it."""
    notebook = Path(notebook)
    data = json.loads(notebook.read_text())
    cells = data["cells"]
    exercises = [i for i, cell in enumerate(cells) if is_exercise(cell)]
    if not exercises:
        raise ValueError(f"{notebook} has no exercise cells (code cells starting with {EXERCISE_MARK!r})")
    for index in exercises:
        checker = _checker_after(cells, index)
        solution = solution_of(cells[checker + 1]) if checker + 1 < len(cells) else None
        if solution is None:
            raise ValueError(f"{notebook}: the exercise in cell {index} has no folded solution after its checker "
                             f"(cell {checker}); write_first makes one")
        cells[index]["source"] = _as_lines(solution.rstrip("\n"))
    for cell in cells:
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    Path(out).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return Path(out)
