"""Both paths through the exercise lessons. The lessons ship their ✏️ cells as stubs (make test runs them as they
are: every checker says NOT WRITTEN YET and the lesson goes on with labkit's reference). Here, the solved path: a
copy with each folded solution put in its cell runs from top to bottom (quick mode), every checker passing; and for
the lessons in FOLDED_ONLY, the folded solutions run through their checker on real ranks."""
import json
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from labkit import exercises as ex
from labkit.exercises import blanks

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXERCISE_LESSONS = ["16_build_ddp_yourself.ipynb", "17_build_zero_yourself.ipynb", "18_pipeline_parallel.ipynb",
                    "14_zero_and_tensor_parallel.ipynb", "19_mixture_of_experts.ipynb"]
# Lessons whose solved copy would add a minute of CI: their folded solution goes through its checker alone (the lesson
# itself runs under make test with labkit's reference in its place). lesson -> (checker of the solution's names, the
# reference that report.use hands back when the solution is not written).
FOLDED_ONLY = {
    "14_zero_and_tensor_parallel.ipynb": (lambda ns: ex.check_tp(ns["MyColumnParallelLinear"], ns["MyRowParallelLinear"]),
                                          lambda ns: (ns["MyColumnParallelLinear"], ns["MyRowParallelLinear"])),
    "18_pipeline_parallel.ipynb": (lambda ns: ex.check_pipeline(ns["my_1f1b"]), lambda ns: ns["my_1f1b"]),
    "19_mixture_of_experts.ipynb": (lambda ns: ex.check_a2a(ns["dispatch"], ns["combine"]),
                                    lambda ns: (ns["dispatch"], ns["combine"])),
}


def checker_cells(notebook) -> int:
    return sum("ex.check_" in cell.source and ".use(" in cell.source for cell in notebook.cells
               if cell.cell_type == "code")


@pytest.mark.parametrize("lesson", EXERCISE_LESSONS)
def test_a_lesson_ships_stubs_with_each_solution_folded_after_its_checker(lesson, tmp_path):
    cells = json.loads((NOTEBOOKS / lesson).read_text())["cells"]
    exercises = [i for i, cell in enumerate(cells) if blanks.is_exercise(cell)]
    assert exercises
    for index in exercises:
        stub = "".join(cells[index]["source"])
        checker = blanks._checker_after(cells, index)
        solution = blanks.solution_of(cells[checker + 1])
        assert solution and "NotImplementedError" not in solution and "<details>" in "".join(cells[checker + 1]["source"])
        compile(solution, lesson, "exec")
        assert "NotImplementedError" in stub and stub == blanks.blank_source(solution.rstrip("\n"))   # its stub
    # and writing it first again changes nothing
    again = blanks.write_first(NOTEBOOKS / lesson, tmp_path / lesson)
    assert json.loads(again.read_text())["cells"] == cells


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lesson", [lesson for lesson in EXERCISE_LESSONS if lesson not in FOLDED_ONLY])
def test_the_solved_copy_runs_through_and_every_checker_passes(lesson, tmp_path, monkeypatch, no_leftovers):
    monkeypatch.setenv("LABKIT_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path / "runs"))
    monkeypatch.delenv("LABKIT_CLAIMS_LOG", raising=False)   # the solved copy's claims are not the lesson's count
    copy = ex.solved_copy(NOTEBOOKS / lesson, tmp_path / lesson)
    notebook = nbformat.read(copy, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.outputs)
    assert checker_cells(notebook) >= 1
    assert "NOT WRITTEN YET" not in text and "not written yet" not in text, text
    assert text.count(": PASSED") >= checker_cells(notebook), text
    assert not any(o.get("output_type") == "error" for c in notebook.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize("lesson", sorted(FOLDED_ONLY))
def test_a_folded_solution_passes_its_checker_on_real_ranks(lesson, monkeypatch, runs_root, no_leftovers):
    monkeypatch.setenv("LABKIT_RUNS", str(runs_root))
    check, names = FOLDED_ONLY[lesson]
    cells = json.loads((NOTEBOOKS / lesson).read_text())["cells"]
    namespace: dict = {"torch": torch, "dist": torch.distributed, "nn": torch.nn, "F": torch.nn.functional}   # the lessons' imports
    for index in [i for i, cell in enumerate(cells) if blanks.is_exercise(cell)]:
        solution = blanks.solution_of(cells[blanks._checker_after(cells, index) + 1])
        exec(compile(solution, f"{lesson}'s solution", "exec"), namespace)
    report = check(namespace)
    assert report.ok, report.text()
    assert report.use("labkit's reference") == names(namespace)   # passed: the learner's own code is used


def test_a_stub_not_written_yet_is_said_and_the_reference_used_while_wrong_code_stops(monkeypatch, capsys):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    stub = ex.Report("Yours on 2 ranks", implementation="stub")
    stub.add("gradients", "missing", "finish_gradient_synchronization is not written yet")
    assert stub.use("reference") == "reference"
    assert "[not written yet] the cells below use labkit's reference until yours passes." in capsys.readouterr().out
    wrong = ex.Report("Yours on 2 ranks", implementation="wrong")
    wrong.add("gradients", "missing", "forward is not written yet")
    wrong.add("gradients", "fail", "gradients are summed, not averaged")
    with pytest.raises(ex.ExerciseFailed, match="summed, not averaged"):
        wrong.use("reference")
