"""The standard every exercise checker meets (issue 46), its shared parts: a failure names the learner's function it
blames (Report.blamed), and a hang or a crash names each rank's place in the learner's code, not in labkit's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import labkit
from labkit.exercises import learner
from labkit.exercises.report import Report
from labkit.run import RankFailure
from labkit.run.failure import RankStatus

LABKIT = Path(labkit.__file__).resolve().parent
TORCH = Path(torch.__file__).resolve().parent
# A faulthandler dump as the watchdog reads it: innermost frame first, the rank's thread last.
DUMP = f'''Current thread 0x00007f (most recent call first):
  File "{TORCH}/distributed/distributed_c10d.py", line 2846 in all_reduce
  File "{LABKIT}/exercises/context.py", line 177 in _exchange
  File "/tmp/ipykernel_41/2841.py", line 12 in combine
  File "/tmp/ipykernel_41/2841.py", line 30 in step
  File "{LABKIT}/exercises/checks_a2a.py", line 90 in _rank
  File "{LABKIT}/run/rank.py", line 120 in rank_main
'''
TRACEBACK = f'''Traceback (most recent call last):
  File "{LABKIT}/run/rank.py", line 120 in rank_main
  File "/home/me/my_ddp.py", line 8 in finish_gradient_synchronization
  File "{TORCH}/distributed/distributed_c10d.py", line 2846 in all_reduce
RuntimeError: boom
'''


def test_the_learners_frame_is_the_innermost_outside_labkit_torch_and_the_standard_library():
    assert learner.learner_frame(DUMP) == ("combine", "2841.py:12 in combine")
    assert learner.learner_frame(TRACEBACK) == ("finish_gradient_synchronization",
                                                "my_ddp.py:8 in finish_gradient_synchronization")
    assert learner.learner_frame(f'  File "{LABKIT}/run/rank.py", line 1 in rank_main\n') == ("", "")
    assert learner.is_learners("/tmp/ipykernel_41/2841.py") and not learner.is_learners(os.__file__)


def test_a_hang_names_each_ranks_place_in_the_learners_code_and_the_call_it_waits_in(tmp_path):
    statuses = [RankStatus(0, "waiting", 2, 1, "waiting inside torch (distributed_c10d.py:2846 in all_reduce), "
                                                 "called at context.py:177 in _exchange, for 9.0 s", DUMP),
                RankStatus(1, "hung", 2, 1, "no progress for 9.0 s", DUMP.replace("line 12 in combine",
                                                                                  "line 14 in combine"))]
    failure = RankFailure(statuses[1], statuses, tmp_path)
    assert learner.hang_places(failure) == {0: ("combine", "2841.py:12 in combine", "all_reduce"),
                                            1: ("combine", "2841.py:14 in combine", "")}
    report = learner.report_failure(Report("x"), failure)
    line = report.findings[-1]
    assert line.status == "fail" and line.part == "combine" and report.blamed == ["combine"]
    assert "rank 0 waits in all_reduce at 2841.py:12 in combine" in line.message
    assert "rank 1 waits in its code at 2841.py:14 in combine" in line.message
    assert "context.py" not in line.message


def test_a_crash_names_the_rank_and_the_learners_line(tmp_path):
    cause = RankStatus(1, "raised", 0, -1, "RuntimeError: boom", TRACEBACK)
    report = learner.report_failure(Report("x"), RankFailure(cause, [cause], tmp_path))
    assert report.blamed == ["finish_gradient_synchronization"]
    assert "rank 1 raised at step 0 at your line my_ddp.py:8 in finish_gradient_synchronization" in report.text()


def test_an_error_a_rank_wrote_down_names_that_rank_and_part(tmp_path):
    (tmp_path / "exercise_error1.json").write_text(json.dumps(
        {"part": "combine", "step": 0, "type": "IndexError", "message": "out of range", "where": "x.py:3 in combine",
         "time": 1.0, "rank": 1}))
    cause = RankStatus(1, "raised", 0, -1, "IndexError: out of range", "")
    report = learner.report_failure(Report("x"), RankFailure(cause, [cause], tmp_path))
    assert report.blamed == ["combine"] and "rank 1: your combine raised IndexError at step 0" in report.text()
    assert "(in your combine)" in report.text()


def test_a_rank_waiting_outside_the_learners_code_is_said_to_wait_in_the_checker(tmp_path):
    outside = f'''Current thread 0x00007f (most recent call first):
  File "{TORCH}/distributed/distributed_c10d.py", line 2846 in all_reduce
  File "{LABKIT}/exercises/checks_a2a.py", line 90 in _rank
  File "{LABKIT}/run/rank.py", line 120 in rank_main
'''
    statuses = [RankStatus(0, "waiting", 1, 0, "waiting inside torch (distributed_c10d.py:2846 in all_reduce)", outside),
                RankStatus(1, "hung", 1, 0, "no progress for 9.0 s", DUMP)]
    report = learner.report_failure(Report("x"), RankFailure(statuses[1], statuses, tmp_path))
    assert "rank 0 waits in all_reduce in the checker's own code, after your code returned" in report.text()
    assert report.blamed == ["combine"]

