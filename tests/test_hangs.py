"""Lesson 12's hangs: each kind is reported by the watchdog (or gloo), naming the rank that diverged and the line, with nothing left
running; the fixes finish; the debugging tools say what the lesson says they say."""
import functools
import re

import pandas as pd
import pytest

import labkit
from labkit.tricks import debugtools, hangs
from .conftest import leftover_processes

TIMEOUT = 2.0
DIVERGING = {"rank0_only": 0, "order": 1, "shape": 1, "loop": 1, "lock": 1}


def points_at_the_bug(failure, kind) -> bool:
    """The report names the marked line: as the caller of the collective, or in the stack it shows."""
    name, line = hangs.bug_line(kind).split(":")
    return f"{name}:{line}" in failure.detail or f'{name}", line {line} in' in failure.traceback


@pytest.fixture(scope="module", autouse=True)
def warm(tmp_path_factory):
    hangs.reproduce("order", fixed=True, runs_root=tmp_path_factory.mktemp("warm"))  # one-off imports, off the clock


@pytest.mark.parametrize("kind", list(hangs.KINDS))
def test_each_hang_is_reported_naming_the_diverging_rank_and_line(kind, runs_root, no_leftovers):
    out = hangs.reproduce(kind, timeout=TIMEOUT, runs_root=runs_root)
    failure = out.failure
    assert failure is not None, f"{kind} finished"
    assert failure.reason == ("signal" if kind == "shape" else "hung"), str(failure)   # the watchdog or gloo
    assert failure.rank == DIVERGING[kind] and failure.step == hangs.AT, str(failure)
    assert points_at_the_bug(failure, kind), str(failure)
    assert not leftover_processes()


@pytest.mark.parametrize("kind", list(hangs.KINDS))
def test_each_fix_runs_to_the_end(kind, runs_root, no_leftovers):
    out = hangs.reproduce(kind, fixed=True, timeout=10, runs_root=runs_root)
    assert out.finished, str(out.failure)
    assert out.run.df.groupby("rank")["step"].max().tolist() == [hangs.STEPS - 1] * 3


def test_the_watchdog_says_which_collective_each_rank_waits_in(runs_root):
    failure = hangs.reproduce("rank0_only", timeout=TIMEOUT, runs_root=runs_root).failure
    states = {s.rank: s for s in failure.statuses}
    assert "in all_reduce" in failure.detail and "odd one out" in failure.detail
    assert all(states[r].state == "waiting" and "in barrier" in states[r].detail for r in (1, 2))


def test_with_two_ranks_a_disagreement_is_reported_without_an_odd_one_out(runs_root, no_leftovers):
    failure = hangs.reproduce("order", world_size=2, timeout=TIMEOUT, runs_root=runs_root).failure
    assert failure.reason == "hung" and "no odd one out" in failure.detail, str(failure)
    assert {s.rank: s.state for s in failure.statuses} in ({0: "hung", 1: "waiting"}, {0: "waiting", 1: "hung"})


def test_gloo_aborts_the_rank_whose_tensor_is_short_and_the_report_says_why(runs_root):
    failure = hangs.reproduce("shape", timeout=TIMEOUT, runs_root=runs_root).failure
    assert failure.reason == "signal" and "SIGABRT" in failure.detail
    assert "Received data size doesn't match expected size" in failure.detail
    assert all(s.because_of == 1 for s in failure.statuses if s.rank != 1), str(failure)
    # Each peer's line in the report names rank 1, however soon it noticed (the launcher waits for it to say so).
    assert all("rank 1 failed" in s.line(failure.statuses[1]) for s in failure.statuses if s.rank != 1)


@pytest.mark.parametrize("kind", ["rank0_only", "order", "loop", "lock"])
def test_the_flight_recorder_finds_the_first_collective_the_ranks_disagree_on(kind, runs_root):
    out = hangs.reproduce(kind, timeout=TIMEOUT, debug=hangs.Debug(flight_recorder=True), runs_root=runs_root)
    records = debugtools.flight_records(out.run)
    assert sorted(records["rank"].unique()) == [0, 1, 2]  # every rank dumped while it hung
    divergence = debugtools.first_divergence(records)
    assert divergence is not None and divergence.odd == [DIVERGING[kind]], records.to_string()
    assert (divergence.places["op"] == "(not issued)").any() == (kind in ("loop", "lock"))


def test_the_flight_recorder_cannot_speak_for_a_rank_that_died(runs_root):
    out = hangs.reproduce("shape", timeout=TIMEOUT, debug=hangs.Debug(flight_recorder=True), runs_root=runs_root)
    records = debugtools.flight_records(out.run)
    assert 1 not in set(records["rank"]) and debugtools.first_divergence(records) is None


@pytest.mark.parametrize("kind, op", [("rank0_only", "ALLREDUCE"), ("order", "BROADCAST"), ("shape", "ALLREDUCE")])
def test_detail_stops_every_rank_at_the_mismatch_and_names_each_ranks_collective(kind, op, runs_root, no_leftovers):
    out = hangs.reproduce(kind, timeout=TIMEOUT, debug=hangs.Debug(level="DETAIL"), runs_root=runs_root)
    assert out.failure.reason == "raised"   # DETAIL's check, not the watchdog, ended it
    prints = debugtools.fingerprints(out.failure)
    assert sorted(prints["rank"]) == [0, 1, 2], str(out.failure)
    keys = {row.rank: (row.op, row.shape) for row in prints.itertuples()}
    assert debugtools.odd_ranks(keys) == [DIVERGING[kind]] and keys[DIVERGING[kind]][0] == op


@pytest.mark.parametrize("kind", ["loop", "lock"])
def test_monitored_barrier_names_the_rank_stuck_in_python_before_the_watchdog(kind, runs_root, no_leftovers):
    out = hangs.reproduce(kind, timeout=10, debug=hangs.Debug(barrier_s=1.0), runs_root=runs_root)
    # rank 0 raised in the barrier, so the watchdog did not end it (no wall-clock bound: a busy core must not fail it)
    assert out.failure.rank == 0 and out.failure.reason == "raised"
    assert out.noticed <= out.seconds   # noticed when rank 0 raised; the report then reads the peers' stacks
    assert re.search(r"Ranks 1 failed to pass monitoredBarrier", out.failure.detail), str(out.failure)


def test_monitored_barrier_cannot_see_ranks_that_are_inside_different_collectives(runs_root, no_leftovers):
    out = hangs.reproduce("order", timeout=TIMEOUT, debug=hangs.Debug(barrier_s=1.0), runs_root=runs_root)
    assert out.failure.reason == "hung" and out.failure.rank == 1  # the watchdog, not the barrier, ended it


@pytest.mark.skipif(debugtools.py_spy() is None, reason="py-spy is not installed")
def test_py_spy_dumps_the_stuck_rank_from_outside(runs_root, no_leftovers):
    with debugtools.SpyOnHang(after_s=0.8, runs_root=runs_root) as spy:
        hangs.reproduce("lock", timeout=4, runs_root=runs_root)
    if spy.problem.startswith("py-spy could not read"):
        pytest.skip(spy.problem)  # ptrace not permitted here
    assert sorted(spy.dumps) == [0, 1, 2], spy.problem
    assert "_write_line (labkit/tricks/hangs.py" in spy.dumps[1] and "all_reduce" in spy.dumps[0]


def test_odd_ranks_is_the_strictly_rarest_group():
    assert debugtools.odd_ranks({0: "a", 1: "b", 2: "a"}) == [1]
    assert debugtools.odd_ranks({0: "a", 1: "b"}) == []
    assert debugtools.odd_ranks({0: "a", 1: "a"}) == []
    assert debugtools.odd_ranks({0: "a", 1: "b", 2: "b", 3: "c", 4: "c"}) == [0]


def test_first_divergence_reports_a_missing_collective_and_agreement_as_none():
    rows = [(r, "pg", s, "all_reduce", "[[4]]", "Float", True, "x.py:1 in f") for r in range(3) for s in (1, 2)]
    records = pd.DataFrame(rows, columns=["rank", "group", "seq", "op", "sizes", "dtypes", "done", "line"])
    assert debugtools.first_divergence(records) is None
    cut = records[~((records["rank"] == 2) & (records["seq"] == 2))]
    found = debugtools.first_divergence(cut)
    assert (found.seq, found.odd) == (2, [2]) and found.places.set_index("rank").loc[2, "op"] == "(not issued)"


def test_bug_lines_point_at_the_marked_lines():
    for kind in hangs.KINDS:
        name, line = hangs.bug_line(kind).split(":")
        source = open(hangs.__file__).read().splitlines()
        assert name == "hangs.py" and hangs.MARK in source[int(line) - 1]


def test_detail_cannot_check_a_collective_a_rank_never_reaches(runs_root, no_leftovers):
    out = hangs.reproduce("loop", timeout=TIMEOUT, debug=hangs.Debug(level="DETAIL"), runs_root=runs_root)
    assert out.failure.reason == "hung" and out.failure.rank == 1 and debugtools.fingerprints(out.failure).empty


@pytest.mark.parametrize("level", ["OFF", "INFO"])
def test_info_names_the_parameters_ddp_never_saw_a_gradient_for(level, runs_root, no_leftovers):
    with pytest.raises(labkit.RankFailure) as info:
        labkit.launch(functools.partial(hangs.ddp_under_debug, level=level, unused=True), world_size=2,
                      timeout=20, runs_root=runs_root, echo=False)
    assert "Parameter indices which did not receive grad" in info.value.detail
    named = "Parameters which did not receive grad for rank" in info.value.detail
    assert named == (level == "INFO") and (not named or "skipped.weight" in info.value.detail)


def test_detail_crashes_ddp_in_a_rank_and_the_report_says_so(runs_root, no_leftovers):
    with pytest.raises(labkit.RankFailure) as info:
        labkit.launch(functools.partial(hangs.ddp_under_debug, level="DETAIL"), world_size=2, timeout=20,
                      runs_root=runs_root, echo=False)
    assert info.value.reason == "signal" and "SIGSEGV" in info.value.detail
    assert "distributed.py" in info.value.traceback and "__init__" in info.value.traceback


def test_a_stack_dump_is_taken_only_once_the_ranks_own_thread_is_written():
    """faulthandler writes the other threads first, each block ending in a blank line; a dump read at that moment
    lacks the rank's thread, and the rank would be reported as stuck in 'unknown code' (seen once on CI)."""
    from labkit.run.diagnose import dump_is_whole
    other = 'Thread 0x00007f4 (most recent call first):\n  File "/x/threading.py", line 331 in wait\n\n'
    mine = ('Current thread 0x00007f5 (most recent call first):\n  File "/t/distributed_c10d.py", line 2 in all_reduce\n'
            '  File "/l/labkit/run/rank.py", line 163 in rank_main\n  File "/p/process.py", line 108 in run\n')
    assert not dump_is_whole(other, other)                  # only the other thread so far, however long we wait
    assert not dump_is_whole(other + mine[:120], other)     # the rank's thread half written
    assert not dump_is_whole(other + mine, other + mine[:120])   # still arriving at the last look
    assert dump_is_whole(other + mine, other + mine)        # written, and nothing more since


def test_lesson_12s_barrier_claim_compares_when_each_failure_was_noticed():
    def timed(**noticed):
        return hangs.Timed({k: hangs.Outcome(k, 9.0, object(), None, v) for k, v in noticed.items()}, 0.0, {})
    hangs.barrier_speaks_first(timed(loop=1.4, lock=1.5, order=2.1))
    for late in (dict(loop=2.2, lock=1.5, order=2.1), dict(loop=1.4, lock=2.1, order=2.1)):
        with pytest.raises(AssertionError):
            hangs.barrier_speaks_first(timed(**late))
    with pytest.raises(AssertionError, match="did not fail"):
        hangs.barrier_speaks_first(timed(loop=None, lock=1.5, order=2.1))


def test_lesson_12s_report_time_claim_allows_the_timeout_plus_five_seconds():
    def timed(*seconds):
        return hangs.Timed({f"k{i}": hangs.Outcome(f"k{i}", s, object(), None) for i, s in enumerate(seconds)}, 0.0,
                           {"timeout": 4.0})
    assert "limit 9 s" in hangs.reported_soon(timed(4.5, 8.9))
    with pytest.raises(AssertionError):
        hangs.reported_soon(timed(4.5, 9.2))


def test_waits_in_reads_each_ranks_step_and_collective(runs_root):
    failure = hangs.reproduce("rank0_only", timeout=TIMEOUT, runs_root=runs_root).failure
    waits = hangs.waits_in(failure)
    assert {r: w[1:] for r, w in waits.items()} == {0: (hangs.AT, ["all_reduce"]), 1: (hangs.AT, ["barrier"]),
                                                   2: (hangs.AT, ["barrier"])}
