"""Lesson 24's checkers: a swap by send/recv (check_swap) and a first script under torchrun (check_script). Each
classic mistake is planted and must be named; a deadlock is reported within seconds at the learner's line."""
from __future__ import annotations

import time

import pytest
import torch

from labkit.exercises import checks_torchrun as ct
from labkit.exercises.checks_p2p import check_swap, swap
from labkit.exercises.report import Report


def test_the_reference_swap_passes_at_4_bytes_and_1_mb(runs_root, no_leftovers):
    report = check_swap(swap, runs_root=runs_root)
    assert report.ok and report.measured["4 bytes"] == report.measured["1 MB"] == "passed", report.text()
    assert report.measured["1 MB sent bytes"] == [2**20, 2**20]
    assert report.use(None) is swap


def sends_first(tensor, wire):
    other = 1 - wire.rank
    got = torch.empty_like(tensor)
    wire.send(tensor, other)
    wire.recv(got, other)
    return got


def test_blocking_sends_first_deadlock_even_at_4_bytes_and_each_rank_is_named_at_its_send(runs_root,
                                                                                        no_leftovers):
    started = time.monotonic()
    report = check_swap(sends_first, timeout=4, runs_root=runs_root)
    assert time.monotonic() - started < 30
    text = report.text()
    assert not report.ok and report.blamed == ["sends_first"] and report.measured["4 bytes"] == "hung", text
    assert text.count("waits in send at test_exercises_first_principles.py") == 2, text
    assert "isend/irecv" in text and "rank 0 sends first" in text, text


def own_tensor(tensor, wire):
    return tensor.clone()


def received_into_mine(tensor, wire):
    other = 1 - wire.rank
    sending = wire.isend(tensor.clone(), other)
    wire.recv(tensor, other)
    sending.wait()
    return tensor


def never_waited(tensor, wire):
    other = 1 - wire.rank
    got = torch.empty_like(tensor)
    wire.isend(tensor, other)
    wire.irecv(got, other).wait()
    return got


def nothing_returned(tensor, wire):
    other = 1 - wire.rank
    got = torch.empty_like(tensor)
    sending = wire.isend(tensor, other)
    wire.recv(got, other)
    sending.wait()


def ordered_by_rank(tensor, wire):
    """Correct another way: blocking calls, rank 0 sends first, rank 1 receives first."""
    other, got = 1 - wire.rank, torch.empty_like(tensor)
    if wire.rank == 0:
        wire.send(tensor, other)
        wire.recv(got, other)
    else:
        wire.recv(got, other)
        wire.send(tensor, other)
    return got


@pytest.mark.parametrize("fn, words", [(own_tensor, "got its own tensor back"),
                                       (received_into_mine, "own tensor was changed"),
                                       (never_waited, "never waited for"),
                                       (nothing_returned, "returned None, not a tensor")])
def test_each_classic_swap_mistake_is_named_with_the_learners_function(fn, words, runs_root, no_leftovers):
    report = check_swap(fn, sizes=(1024,), runs_root=runs_root)
    assert not report.ok and report.blamed == [fn.__name__], report.text()
    assert words in report.text(), report.text()


def test_a_swap_ordered_by_rank_passes_and_the_stub_is_not_written_yet(runs_root, no_leftovers):
    assert check_swap(ordered_by_rank, runs_root=runs_root).ok

    def my_swap(tensor, wire):
        raise NotImplementedError("my_swap is not written yet")

    stub = check_swap(my_swap, runs_root=runs_root)
    assert stub.missing and not stub.failures and stub.use(swap) is swap, stub.text()


# The script: the contract's lines judged (no job needed), then real jobs under torchrun.
def judged(lines: dict, nproc: int = 2) -> Report:
    report = Report("script")
    if ct._judge(report, lines, nproc, "first_job.py"):
        report.add("end", "pass", "judged")
    return report


CPU = "cuda:0" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("lines, words", [
    ({0: ("0", "2", "0", CPU, "3")}, "printed no line"),
    ({0: ("0", "2", "0", CPU, "3"), 1: ("0", "2", "1", CPU, "3")}, "said ranks [0, 0]"),
    ({0: ("0", "1", "0", CPU, "3"), 1: ("1", "1", "1", CPU, "3")}, "read WORLD_SIZE"),
    ({0: ("0", "2", "0", CPU, "3"), 1: ("1", "2", "0", CPU, "3")}, "read LOCAL_RANK"),
    ({0: ("0", "2", "0", "meta", "3"), 1: ("1", "2", "1", "meta", "3")}, "used device meta"),
    ({0: ("0", "2", "0", CPU, "1"), 1: ("1", "2", "1", CPU, "2")}, "its own value"),
    ({0: ("0", "2", "0", CPU, "1.5"), 1: ("1", "2", "1", CPU, "1.5")}, "want 1 + ... + 2 = 3")])
def test_each_wrong_line_of_the_contract_is_named(lines, words):
    report = judged(lines)
    assert not report.ok and words in report.text() and report.blamed == ["first_job.py"], report.text()
    if not words.startswith("used device"):
        assert judged({0: ("0", "2", "0", CPU, "3"), 1: ("1", "2", "1", CPU, "3")}).ok


def test_a_script_without_destroy_process_group_is_named_and_a_stub_or_a_missing_file_is_not_written_yet(
        tmp_path):
    report = Report("script")
    ct._cleanup(report, ct.ast.parse(ct.FIRST_JOB.read_text().replace("dist.destroy_process_group()", "")), "x.py")
    assert not report.ok and "destroy_process_group() is never called" in report.text()
    stub = tmp_path / "stub.py"
    stub.write_text('def main():\n    raise NotImplementedError("main is not written yet")\n')
    for path in (stub, tmp_path / "absent.py"):
        report = ct.check_script(path)   # neither starts a job
        assert report.missing and not report.failures, report.text()
    broken = tmp_path / "broken.py"
    broken.write_text("def main(:\n")
    assert "does not parse" in ct.check_script(broken).text()


# labkit's first_job.py passing under torchrun is lesson 24's own claim (it runs it while the stub is unsolved), and
# the folded solution goes through check_script in test_exercises_notebooks: neither is run a third time here.


def test_a_rank_written_into_the_script_hangs_and_is_named_within_seconds(monkeypatch, runs_root, tmp_path,
                                                                          no_leftovers):
    monkeypatch.setenv("LABKIT_RUNS", str(runs_root))
    script = tmp_path / "hard_rank.py"
    script.write_text(ct.FIRST_JOB.read_text().replace('rank = int(os.environ["RANK"])', "rank = 0").replace(
        'init_method="env://")', 'init_method="env://", rank=rank, world_size=world)'))
    started = time.monotonic()
    report = ct.check_script(script, timeout=5)
    assert time.monotonic() - started < 45   # torchrun's start (seconds) plus 5 s without progress
    text = report.text()
    assert not report.ok and "made no progress" in text and "hard_rank.py:" in text, text
    assert "a rank number written into the script" in text and report.blamed == ["main"], text


def test_a_collective_before_init_process_group_is_named(monkeypatch, runs_root, tmp_path, no_leftovers):
    monkeypatch.setenv("LABKIT_RUNS", str(runs_root))
    script = tmp_path / "no_init.py"
    script.write_text("\n".join(line for line in ct.FIRST_JOB.read_text().splitlines()
                                if "init_process_group(" not in line) + "\n")
    report = ct.check_script(script, timeout=5)
    assert not report.ok and "before init_process_group()" in report.text(), report.text()
