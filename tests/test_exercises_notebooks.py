"""Blank mode end to end: a blank copy of each exercise lesson runs from top to bottom (quick mode), every checker
saying what is not written yet instead of stopping the notebook, the later cells going on with labkit's reference."""
import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from labkit.exercises import blank_copy

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lesson", ["16_build_ddp_yourself.ipynb", "17_build_zero_yourself.ipynb"])
def test_a_blank_copy_runs_through_and_reports_what_is_missing(lesson, tmp_path, monkeypatch, no_leftovers):
    monkeypatch.setenv("LABKIT_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path / "runs"))
    copy = blank_copy(NOTEBOOKS / lesson, tmp_path / lesson)
    notebook = nbformat.read(copy, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.outputs)
    checkers = sum("ex.check_" in cell.source and "= ex.check_" in cell.source and ".use(" in cell.source
                   for cell in notebook.cells if cell.cell_type == "code")
    assert checkers >= 1
    assert text.count("NOT WRITTEN YET") == checkers, text
    assert text.count("[blank mode] the cells below use labkit's") == checkers, text
    assert "blank mode: True" in text
    assert not any(o.get("output_type") == "error" for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    assert json.loads(copy.read_text())["cells"][0]["cell_type"] == "code"
