"""Answers that are a number or a name (labkit.exercises.answers), and the two cell forms blanks.py adds for them
and for scripts: an answer line `NAME = value  # ✏️ ...`, and a `%%writefile` cell with the mark on its second line.
No rank runs here."""
from __future__ import annotations

import json

import pytest

from labkit.exercises import answers, blanks

SIZE, N, T = 64 * 2**20, 4, 0.02
BUSBW = 2 * (N - 1) / N * SIZE / T / 1e9


def test_a_number_right_by_the_formula_passes_and_is_what_use_hands_back():
    report = answers.check_number(BUSBW * 1.01, "bus bandwidth", formula=BUSBW, measured=BUSBW * 1.2, unit=" GB/s")
    assert report.ok and report.use(0.0) == BUSBW * 1.01
    assert report.status("measured") == "pass" and "20% from the formula" in report.text()


def test_a_usual_slip_is_named_and_any_other_number_is_said_as_a_ratio():
    slips = {"the algorithm bandwidth: the 2(n-1)/n a ring all-reduce moves is missing": SIZE / T / 1e9}
    slipped = answers.check_number(SIZE / T / 1e9, "bus bandwidth", formula=BUSBW, slips=slips)
    assert not slipped.ok and slipped.blamed == ["bus bandwidth"]
    assert "0.667x the formula's" in slipped.text() and "2(n-1)/n" in slipped.text()
    other = answers.check_number(BUSBW * 3, "bus bandwidth", formula=BUSBW, slips=slips)
    assert "3.000x the formula's" in other.text() and "none of the usual slips" in other.text()


def test_the_stub_is_not_written_yet_and_the_lesson_goes_on_with_the_reference(capsys):
    report = answers.check_number(..., "bus bandwidth", formula=BUSBW)
    assert not report.ok and report.missing and not report.failures
    assert report.use(BUSBW) == BUSBW and "not written yet" in capsys.readouterr().out


def test_not_a_number_and_a_measurement_far_from_the_model_are_told_apart():
    assert "not a finite number" in answers.check_number("fast", "x", formula=1.0).text()
    assert "not a finite number" in answers.check_number(float("nan"), "x", formula=1.0).text()
    far = answers.check_number(1.0, "x", formula=1.0, measured=3.0)
    assert far.ok and far.status("measured") == "note" and "the model and this machine part" in far.text()


def test_a_name_is_judged_by_equality_and_a_known_wrong_answer_says_why():
    assert answers.check_name(1, "the straggler", want=1).ok
    wrong = answers.check_name(0, "the straggler", want=1, wrong={0: "rank 0 is the one the others waited for"})
    assert not wrong.ok and "the others waited for" in wrong.text() and wrong.blamed == ["the straggler"]
    assert answers.check_name(..., "the straggler", want=1).missing


SCRIPT = """%%writefile train.py
# ✏️ EXERCISE · your first torchrun script
import os
WORLD: int = int(os.environ["WORLD_SIZE"])  # ✏️ read it from the environment
CHUNK = 4 * 2**20  # ✏️ the bytes per chunk
KEEP = 3
def main():
    \"\"\"Join the group, say hello, leave.\"\"\"
    print("hello")
"""


def test_answer_lines_and_a_writefile_script_are_blanked_and_the_rest_is_kept():
    stub = blanks.blank_source(SCRIPT)
    assert stub.startswith("%%writefile train.py\n# ✏️ EXERCISE")
    assert "WORLD: int = ...  # ✏️ read it from the environment" in stub
    assert "CHUNK = ...  # ✏️ the bytes per chunk" in stub and "KEEP = 3" in stub
    assert 'raise NotImplementedError("main is not written yet")' in stub and '"""Join the group' in stub
    assert blanks.is_exercise({"cell_type": "code", "source": [SCRIPT]})
    assert not blanks.is_exercise({"cell_type": "code", "source": ["%%time\n# ✏️ EXERCISE · no\nx = 1"]})
    assert blanks.split_magic(SCRIPT)[0] == "%%writefile train.py"


def test_a_writefile_exercise_goes_round_write_first_and_solved_copy(tmp_path):
    cells = [{"cell_type": "code", "execution_count": None, "id": "a", "metadata": {}, "outputs": [],
              "source": [SCRIPT]},
             {"cell_type": "code", "execution_count": None, "id": "b", "metadata": {}, "outputs": [],
              "source": ["report = check(...)\nreport.use(None)"]}]
    lesson = tmp_path / "24_x.ipynb"
    lesson.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    blanks.write_first(lesson)
    written = json.loads(lesson.read_text())["cells"]
    assert "".join(written[0]["source"]) == blanks.blank_source(SCRIPT)
    assert blanks.solution_of(written[2]).rstrip("\n") == SCRIPT.rstrip("\n")
    assert "your first torchrun script" in "".join(written[2]["source"])
    solved = json.loads(blanks.solved_copy(lesson, tmp_path / "solved.ipynb").read_text())["cells"]
    assert "".join(solved[0]["source"]).rstrip("\n") == SCRIPT.rstrip("\n")


@pytest.mark.parametrize("value", [BUSBW, BUSBW * 0.99])
def test_a_number_within_rel_of_the_formula_passes(value):
    assert answers.check_number(value, "b", formula=BUSBW, rel=0.02).ok
