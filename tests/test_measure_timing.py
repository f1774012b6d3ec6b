"""Pinned cores, the CPU meter and interleaved timing: pure parts directly, the whole with real gloo ranks."""
from __future__ import annotations

import os
import time

import pandas as pd
import pytest

import labkit
from labkit import RunConfig
from labkit.measure import CpuMeter, interleaved, pinned_to
from labkit.measure.timing import least_disturbed, steady_step_s, steady_window


class FakeRun:
    name = "fake"

    def __init__(self, ends):
        self.df = pd.DataFrame([{"rank": r, "step": s, "time": t + 0.01 * r} for s, t in enumerate(ends)
                                for r in (0, 1)])


def test_pinned_to_narrows_the_mask_and_restores_it():
    before = os.sched_getaffinity(0)
    with pinned_to(1) as used:
        assert os.sched_getaffinity(0) == set(used) and len(used) == 1
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ValueError, match="ask for 1.."):
        with pinned_to(len(before) + 1):
            pass


def test_the_meter_splits_ours_from_others_between_two_times():
    meter = CpuMeter()
    meter.samples = [(0.0, 0.0, 0.0), (1.0, 1.5, 1.75), (2.0, 3.0, 3.5)]
    assert meter.cores_busy(0.5, 1.5) == (1.5, 0.25)


def test_the_meter_sees_our_own_work_on_the_pinned_core():
    with pinned_to(1), CpuMeter() as meter:
        started, cpu_started = time.time(), time.process_time()
        while time.time() - started < 0.6:
            pass                                    # a busy loop: as much of the core as we are given
        ended, cpu_used = time.time(), time.process_time() - cpu_started
    assert meter.cores == [sorted(os.sched_getaffinity(0))[0]]
    ours, others = meter.cores_busy(started, ended)
    # What the meter saw of us matches what the kernel says we used (however busy the machine is).
    assert ours == pytest.approx(cpu_used / (ended - started), abs=0.15) and ours > 0.05
    assert others >= 0.0


def test_the_steady_window_leaves_out_warmup_and_the_last_step():
    run = FakeRun([1.0, 2.0, 2.5, 3.0, 3.5, 9.0])     # the last step also stops workers: left out
    start, end, steps = steady_window(run, warmup=2)
    assert (start, end, steps) == (2.01, 3.51, 3)     # steps 2, 3, 4, each ended by its slowest rank
    assert steady_step_s(run, warmup=2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 7"):
        steady_window(run, warmup=5)
    with pytest.raises(ValueError, match="warmup = 0"):
        steady_window(run, warmup=0)


def test_the_least_disturbed_repeat_is_kept_then_the_fastest():
    assert least_disturbed([(0.52, 0.030, "a"), (0.04, 0.034, "b"), (0.01, 0.031, "c")]) == "c"
    assert least_disturbed([(0.6, 0.01, "busy but fast"), (0.0, 0.05, "quiet")]) == "quiet"
    with pytest.raises(ValueError):
        least_disturbed([])


def test_variants_run_interleaved_pinned_and_metered(runs_root, no_leftovers):
    order = []

    def where(ctx):                          # each variant reports the cores it ran on
        for step in range(4):
            ctx.record(step, samples=1, t_step=0.01)
            time.sleep(0.02)
        return sorted(os.sched_getaffinity(0))

    def variant(label):
        def start():
            order.append(label)
            return labkit.launch(where, world_size=2, name=label, echo=False, progress=False, runs_root=runs_root)
        return start

    timed = interleaved({"a": variant("a"), "b": variant("b")}, rounds=3, cores=1)
    assert order == ["a", "b", "b", "a", "a", "b"]                 # rounds alternate their order
    first_core = [sorted(os.sched_getaffinity(0))[0]]
    for label, t in timed.items():
        assert t.label == label and t.run.result(0) == t.run.result(1) == first_core   # pinned ranks
        assert len(t.repeats) == 3 and t.others >= 0 and t.ours >= 0
        assert t.step_s == pytest.approx(0.02, abs=0.03)
    assert timed.others == max(t.others for t in timed.values())
    assert list(timed.table().index) == ["a", "b"]
    assert list(timed.only(["b"])) == ["b"]
    assert timed.only(["b"]).wait_for_quiet(99.0, timeout_s=1.0) <= 99.0       # watches the cores it pinned
    again = timed.only(["b"]).again()
    assert list(again) == ["b"] and order[6:] == ["b", "b", "b"]


def test_configs_are_launched_under_their_labels(runs_root, no_leftovers):
    cfg = RunConfig(task="digits", world_size=1, global_batch=16, steps=5, tensorboard=False, save_final=False)
    timed = interleaved({"w1": cfg, "w2": cfg.replace(world_size=2)}, rounds=1, cores=2, warmup=2,
                        runs_root=runs_root)
    assert [t.run.name for t in timed.values()] == ["w1", "w2"]
    assert timed["w2"].run.world_size == 2 and timed["w1"].step_s > 0
    with pytest.raises(TypeError, match="pass a RunConfig"):
        interleaved({"bad": 3}, rounds=1, cores=1)
    with pytest.raises(ValueError, match="rounds = 0"):
        interleaved({"w1": cfg}, rounds=0, cores=1)


def test_subsets_by_label_or_position_and_joins_keep_how_they_were_measured():
    from labkit.measure import Timing, Timings
    settings = dict(rounds=1, cores=1, warmup=1)
    timed = Timings({k: Timing(k, None, 0.1, 1.0, o) for k, o in (("a", 0.1), ("b", 0.5), ("c", 0.0))},
                    {"a": 1, "b": 2, "c": 3}, settings)
    assert list(timed.only([2, "a"])) == ["c", "a"] and timed.only([2, "a"]).variants == {"c": 3, "a": 1}
    assert timed.only(["a", "c"]).others == 0.1 and timed.others == 0.5
    joined = timed.only(["a"]) | timed.only(["c"])
    assert list(joined) == ["a", "c"] and joined.settings == settings and joined.variants == {"a": 1, "c": 3}
    with pytest.raises(KeyError, match="no variant"):
        timed.only(["z"])
    with pytest.raises(ValueError, match="same rounds"):
        timed | Timings({}, {}, dict(settings, rounds=2))


def _burn(seconds):
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass


def test_short_lived_children_count_as_ours_not_as_others():
    """DataLoader workers restarted every epoch live between two samples of the meter: their CPU is ours. The truth
    comes from the kernel's count of reaped children's CPU (getrusage), whatever else runs on the machine."""
    import multiprocessing as mp
    import resource
    fork = mp.get_context("fork")

    def children_cpu():
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    before = children_cpu()
    with pinned_to(1), CpuMeter() as meter:
        for _ in range(30):
            child = fork.Process(target=_burn, args=(0.015,))   # shorter than the meter's interval
            child.start()
            child.join()
    burned = children_cpu() - before
    (t0, ours0, _), (t1, ours1, _) = meter.samples[0], meter.samples[-1]
    assert burned >= 30 * 0.015 and ours1 - ours0 > 0.95 * burned, (ours1 - ours0, burned)


def test_waiting_for_quiet_cores_returns_when_quiet_or_when_time_is_up():
    from labkit.measure.cores import others_now, wait_for_quiet
    assert others_now(1, 0.2) >= 0.0
    started = time.time()
    assert wait_for_quiet(1, limit=99.0, timeout_s=5.0, window_s=0.2) <= 99.0     # anything is quiet enough
    assert time.time() - started < 1.0
    started = time.time()
    wait_for_quiet(1, limit=-1.0, timeout_s=0.6, window_s=0.2)                   # nothing is quiet enough
    assert 0.4 < time.time() - started < 2.0
