"""Lesson 22's checks on watched runs (labkit/tricks/watched_claims.py), on run directories written by hand."""
import json
import math
import os
import sys
import types

import pandas as pd
import pytest

import labkit
from labkit.records import write_meta
from labkit.tricks import monitor, watched_claims as wc


def fake_run(path, losses, printed="", ended_after=1.5, t_step=0.01, lags=None):
    """A run directory as labkit watch leaves it: rank<r>.jsonl, job.log, meta.json. losses: {rank: [loss per step]}."""
    path.mkdir()
    last = 0.0
    for rank, values in losses.items():
        with open(path / f"rank{rank}.jsonl", "w") as f:
            for step, loss in enumerate(values):
                last = max(last, 1000.0 + step)
                f.write(json.dumps({"rank": rank, "step": step, "loss": loss, "t_step": t_step, "time": 1000.0 + step})
                        + "\n")
    (path / "job.log").write_text(printed)
    write_meta(path, launched_at=999.0, ended_at=last + ended_after)
    return labkit.Run(path)


def test_line_of_names_the_file_and_line_of_the_first_match():
    here = wc.line_of(wc, "def line_of(")
    name, number = here.split(":")
    assert name == "watched_claims.py"
    assert "def line_of(" in open(wc.__file__).read().splitlines()[int(number) - 1]
    with pytest.raises(ValueError):
        wc.line_of(wc, "no such text anywhere " * 2)


def test_printed_losses_parse_every_digit_and_skip_other_lines(tmp_path):
    out = ("W torchrun says hello\nrank 1 step 0 loss 0.5748004317283630\nrank 0 step 0 loss nan\nnoise\n"
           "rank 0 step 1 loss 1.5e-05rank 1 step 1 loss 0.25\n\n")      # two ranks' lines interleaved
    run = fake_run(tmp_path / "r", {0: [math.nan, 1.5e-05], 1: [0.574800431728363, 0.25]}, printed=out)
    printed = wc.printed_losses(run)
    assert printed[["rank", "step"]].values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert math.isnan(printed["loss"][0]) and printed["loss"][2] == 0.574800431728363 and printed["loss"][1] == 1.5e-05
    assert monitor.loss_gap(printed, run) == 0.0  # a NaN against a NaN counts as equal


def test_loss_gap_and_first_difference(tmp_path):
    a = fake_run(tmp_path / "a", {0: [1.0, 2.0, 3.0], 1: [1.5, 2.5, 3.5]})
    b = fake_run(tmp_path / "b", {0: [1.0, 2.0, 3.25], 1: [1.5, math.nan, 3.5]})
    assert monitor.loss_gap(a, b) == math.inf     # a number against a NaN
    assert wc.first_difference(a, b) == 1
    assert wc.first_difference(a, a) is None
    short = fake_run(tmp_path / "c", {0: [1.0, 2.0], 1: [1.5, 2.5]})
    assert monitor.loss_gap(a, short) == math.inf  # the shared steps agree, the keys do not
    assert wc.steps_per_rank(a) == {0: 3, 1: 3} and wc.steps_per_rank(short) == {0: 2, 1: 2}


def test_reported_within_is_a_gated_check_that_asserts(tmp_path):
    run = fake_run(tmp_path / "r", {0: [1.0, 2.0], 1: [1.0, 2.0]}, ended_after=4.0)
    assert wc.report_delay(run) == pytest.approx(4.0)
    measured = types.SimpleNamespace(value=run)
    assert "4.0 s" in wc.reported_within(measured, 8.0)
    with pytest.raises(AssertionError):
        wc.reported_within(measured, 3.0)


def test_everyone_slowed_asserts_on_step_times(tmp_path):
    fast = types.SimpleNamespace(value=fake_run(tmp_path / "f", {0: [1.0] * 3, 1: [1.0] * 3}, t_step=0.01))
    slow = types.SimpleNamespace(value=fake_run(tmp_path / "s", {0: [1.0] * 3, 1: [1.0] * 3}, t_step=0.2))
    assert "rank 1 200 ms" in wc.everyone_slowed(slow, 0.15)
    with pytest.raises(AssertionError):
        wc.everyone_slowed(fast, 0.15)


def test_the_straggler_checks_read_arrival_times(tmp_path):
    path = tmp_path / "r"
    path.mkdir()
    for rank, late in ((0, 0.0), (1, 0.15)):
        with open(path / f"rank{rank}.jsonl", "w") as f:
            for step in range(4):
                t = int((1000.0 + step + late) * 1e9)
                f.write(json.dumps({"rank": rank, "step": step, "loss": 1.0, "t_step": 0.16, "time": 1000.0 + step,
                                    "arrivals": [[step + 1, "gloo:all_reduce", t]]}) + "\n")
    (path / "watch.json").write_text(json.dumps({"outcome": "finished", "code": 0, "cause_rank": None,
                                                 "cause_step": None, "failure": ""}))
    measured = types.SimpleNamespace(value=labkit.Run(path))
    assert wc.median_lags(measured.value) == pytest.approx({0: 0.0, 1: 0.15}, abs=1e-3)
    assert wc.straggler_named(measured, 1) == "stragglers [1]"
    assert "rank 1 150 ms" in wc.late_by_the_sleep(measured, 1, 0.15)
    with pytest.raises(AssertionError):
        wc.late_by_the_sleep(measured, 0, 0.15)
    with pytest.raises(AssertionError):
        wc.straggler_named(measured, 0)


def test_step_ids_and_collective_ids_read_the_records(tmp_path):
    path = tmp_path / "r"
    path.mkdir()
    ops = {0: [[1, "gloo:broadcast", 5], [2, "gloo:all_reduce", 6]], 1: [[3, "gloo:all_reduce", 7]]}
    for rank in (0, 1):
        with open(path / f"rank{rank}.jsonl", "w") as f:
            for step in (0, 1) if rank == 0 else (0,):
                f.write(json.dumps({"rank": rank, "step": step, "loss": 1.0, "time": 1000.0 + step,
                                    "arrivals": ops[step]}) + "\n")
    run = labkit.Run(path)
    assert wc.step_ids(run) == {0: [0, 1], 1: [0]}
    seen = wc.collective_ids(run)
    assert seen[seen["rank"] == 0][["step", "seq", "op"]].values.tolist() == [
        [0, 1, "broadcast"], [0, 2, "all_reduce"], [1, 3, "all_reduce"]]


def test_unwatched_runs_the_command_without_the_agent_and_reads_what_it_printed(tmp_path, monkeypatch):
    from labkit.run.watch import SITE_DIR
    from labkit.training import agent
    monkeypatch.setenv(agent.DIR_ENV, str(tmp_path))                 # as if this process ran under labkit watch
    monkeypatch.setenv("PYTHONPATH", f"{SITE_DIR}{os.pathsep}{tmp_path}")
    script = ("import os, sys; env = os.environ; "
              f"assert {agent.DIR_ENV!r} not in env, 'the run directory leaked'; "
              f"assert {str(SITE_DIR)!r} not in env.get('PYTHONPATH', ''), 'the agent would start'; "
              "print('rank 0 step 0 loss 0.5'); print('rank 1 step 0 loss 0.25')")
    printed = wc.unwatched([sys.executable, "-c", script])
    assert printed.values.tolist() == [[0, 0, 0.5], [1, 0, 0.25]]
    with pytest.raises(RuntimeError, match="exited 3 unwatched"):
        wc.unwatched([sys.executable, "-c", "import sys; sys.exit(3)"])
