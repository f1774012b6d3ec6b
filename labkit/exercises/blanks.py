"""Start a lesson from blanks: copy a notebook with the bodies of its ✏️ exercise cells emptied.

    blank_copy("notebooks/16_build_ddp_yourself.ipynb")   # -> notebooks/16_build_ddp_yourself.blank.ipynb
    python -m labkit.exercises blank notebooks/16_build_ddp_yourself.ipynb      # the same, from a terminal

In the copy, every function and method defined in a cell that starts with EXERCISE_MARK keeps its signature and
docstring, and its body becomes `raise NotImplementedError("<name> is not written yet")`. A first cell sets
LABKIT_EXERCISES=blank, so each checker reports what is still missing instead of stopping the notebook, and the
cells after it go on with labkit's reference until yours passes. Everything else in the notebook is unchanged.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

from .report import MODE_ENV

EXERCISE_MARK = "# ✏️ EXERCISE"
MODE_CELL = (f"# A blank copy made by labkit.exercises.blank_copy: the ✏️ cells are yours to fill in.\n"
             f"# Checkers say what is missing; until yours passes, the cells below use labkit's reference.\n"
             f"import os\nos.environ[{MODE_ENV!r}] = \"blank\"")


def blank_source(source: str) -> str:
    """`source` with every function body (methods included) replaced by a NotImplementedError naming it."""
    lines = source.split("\n")
    edits: list[tuple[int, int, str]] = []  # (first line index, last line index, replacement)

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
                raise_line = " " * body[0].col_offset + \
                    f'raise NotImplementedError("{prefix}{child.name} is not written yet")'
                if rest:
                    edits.append((rest[0].lineno - 1, child.end_lineno - 1, raise_line))
                else:
                    edits.append((child.end_lineno, child.end_lineno - 1, raise_line))

    visit(ast.parse(source), "")
    for first, last, replacement in sorted(edits, reverse=True):
        lines[first:last + 1] = [replacement]
    return "\n".join(lines)


def is_exercise(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and "".join(cell.get("source", [])).lstrip().startswith(EXERCISE_MARK)


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
