"""Synchronous DDP, local SGD and Hogwild on real gloo ranks (world 2): who holds which parameters, when."""
import math

import pytest
import torch

import labkit
from labkit import RunConfig
from labkit.tricks.averaging import Hogwild, LocalSGD, averages_at, shared_model, sync_ddp, timeline

CFG = RunConfig(task="digits", world_size=2, global_batch=32, optimizer="sgd", lr=0.05, steps=7,
                tensorboard=False, save_final=False)


def _rank0(run, column):
    return run.df[run.df["rank"] == 0][column].tolist()


def test_averages_at_follows_the_periodic_model_averager_rule():
    assert [s for s in range(10) if averages_at(s, period=3)] == [0, 3, 6, 9]
    assert [s for s in range(10) if averages_at(s, period=4, warmup=2)] == [2, 6]
    assert all(averages_at(s, period=1) for s in range(5))


def test_bad_periods_are_rejected_before_anything_starts():
    with pytest.raises(ValueError, match="period = 0"):
        LocalSGD(period=0)
    with pytest.raises(ValueError, match="warmup = -1"):
        LocalSGD(period=2, warmup=-1)


def test_period_1_keeps_ranks_identical_and_matches_synchronous_sgd(runs_root, no_leftovers):
    sync = labkit.launch(sync_ddp, config=CFG, runs_root=runs_root, echo=False, timeout=30)
    local = labkit.launch(LocalSGD(period=1), config=CFG, runs_root=runs_root, echo=False, timeout=30)
    assert _rank0(sync, "divergence") == _rank0(sync, "divergence_before") == [0.0] * 7   # bit for bit
    assert _rank0(local, "divergence") == [0.0] * 7                  # averaged back together every step
    assert min(_rank0(local, "divergence_before")) > 0               # after each local step, before averaging
    # SGD (with momentum) is linear in the gradient: averaging parameters = averaging gradients, up to rounding.
    assert local.steps()["loss"].tolist() == pytest.approx(sync.steps()["loss"].tolist(), abs=1e-5)
    assert sync.result(0)["final_divergence"] == local.result(1)["final_divergence"] == 0.0
    # the metric all-reduce (hvd.allreduce) gives the mean of the ranks' recorded losses
    assert sync.result(0)["final_loss"] == pytest.approx(sync.steps()["loss"].iloc[-1], abs=1e-6)
    params = sum(p.numel() for p in shared_model(CFG).parameters())
    assert _rank0(sync, "comm_bytes") == _rank0(local, "comm_bytes") == [params * 4] * 7


def test_a_larger_period_lets_ranks_diverge_and_brings_them_together_at_each_averaging(runs_root, no_leftovers):
    run = labkit.launch(LocalSGD(period=4), config=CFG, runs_root=runs_root, echo=False, timeout=30)
    before, after = _rank0(run, "divergence_before"), _rank0(run, "divergence")
    averaged = [s for s in range(7) if averages_at(s, period=4)]
    assert _rank0(run, "averaged") == [int(s in averaged) for s in range(7)]
    assert [s for s in range(7) if after[s] == 0.0] == averaged == [0, 4]   # exactly equal bits again
    assert all(b > 0 for b in before)
    assert after[1] < after[2] < after[3] < before[4] and before[5] < before[6]   # growing between averagings
    assert run.df.groupby("step")["divergence"].nunique().eq(1).all()  # every rank measures the same number
    from labkit.tricks.averaging import ranks_sent_alike
    assert ranks_sent_alike(run) == (7, True)
    params = sum(p.numel() for p in shared_model(CFG).parameters())
    assert _rank0(run, "comm_bytes") == [params * 4 if s in averaged else 0 for s in range(7)]   # counted
    assert _rank0(run, "allreduces") == [int(s in averaged) for s in range(7)]
    # the run ends between averagings; the model it keeps is the ranks' mean, the same on both
    assert run.result(0)["final_divergence"] == after[-1] > 0
    assert run.result(0)["eval_accuracy"] == run.result(1)["eval_accuracy"]


def test_an_averager_that_sends_nothing_fails_lesson_06s_traffic_and_reunion_asserts(runs_root, monkeypatch):
    # As if the parameters were never averaged (every .grad None, or a frozen model): nothing is sent, and the
    # records say so, where a byte count derived from the schedule would still have claimed 1/period of sync's.
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    monkeypatch.setattr(PeriodicModelAverager, "average_parameters", lambda self, params: None)
    run = labkit.launch(LocalSGD(period=4), config=CFG, runs_root=runs_root, echo=False, timeout=30)
    t = timeline(run)
    assert t["comm_bytes"].sum() == 0 and t["averaged"].sum() == 0     # lesson 06: "1/k of sync's bytes" fails
    assert (t["divergence"] > 0).all()                                  # lesson 06: "drops to exactly 0" fails


def test_warmup_all_reduces_gradients_first_then_goes_local(runs_root, no_leftovers):
    run = labkit.launch(LocalSGD(period=4, warmup=3), config=CFG, runs_root=runs_root, echo=False, timeout=30)
    before, after = _rank0(run, "divergence_before"), _rank0(run, "divergence")
    assert before[:3] == [0.0] * 3 and all(b > 0 for b in before[3:])
    assert [s for s in range(7) if after[s] == 0.0] == [0, 1, 2, 3]   # synchronous, then averaged at step 3
    params = sum(p.numel() for p in shared_model(CFG).parameters())
    # gradients all-reduced with the other rank for 3 steps, then parameters at step 3, then nothing leaves a rank
    assert _rank0(run, "comm_bytes") == [params * 4] * 4 + [0] * 3


def test_timeline_counts_samples_and_wall_time(runs_root):
    run = labkit.launch(LocalSGD(period=2), config=CFG, runs_root=runs_root, echo=False, timeout=30)
    t = timeline(run)
    assert t["samples_seen"].tolist() == [32 * (s + 1) for s in range(7)]
    assert t["wall_s"].is_monotonic_increasing and t["wall_s"].iloc[-1] > 0
    assert t["averaged"].tolist() == [1, 0, 1, 0, 1, 0, 1]


def test_hogwild_ranks_train_the_one_model_in_shared_memory(runs_root, no_leftovers):
    cfg = CFG.replace(steps=20)
    model = shared_model(cfg)
    start = [p.detach().clone() for p in model.parameters()]
    run = labkit.launch(Hogwild(model), config=cfg, runs_root=runs_root, echo=False, timeout=30,
                        start_method="fork")
    assert sorted(run.df["rank"].unique()) == [0, 1] and len(run.df) == 40
    assert run.df["allreduces"].sum() == run.df["comm_bytes"].sum() == 0    # counted: no collective at all
    assert all(not torch.equal(a, p) for a, p in zip(start, model.parameters()))  # written by the ranks
    steps = run.steps()
    assert steps["loss"].iloc[-5:].mean() < steps["loss"].iloc[:5].mean()
    assert all(math.isfinite(v) for v in run.df["loss"])


def test_hogwild_refuses_a_model_that_is_not_shared(runs_root, no_leftovers):
    model = torch.nn.Linear(64, 10)   # not in shared memory: each rank would train its own copy
    with pytest.raises(labkit.RankFailure, match="not in shared memory"):
        labkit.launch(Hogwild(model), config=CFG, runs_root=runs_root, echo=False, timeout=30, start_method="fork")


def _timeline(period, steps, *, skip=None):
    """A made-up timeline of a local-SGD run: bytes and reunions at the averager's steps (but not at `skip`)."""
    import pandas as pd
    rows = []
    for s in range(steps):
        avg = averages_at(s, period) and s != skip
        rows.append({"step": s, "comm_bytes": 400 if avg else 0, "allreduces": int(avg),
                     "divergence_before": 0.1 + (s % period) * 0.1, "divergence": 0.0 if avg else 0.1 + (s % period) * 0.1})
    return pd.DataFrame(rows)


def test_the_lessons_claims_about_a_local_sgd_timeline_hold_on_a_good_one_and_fail_on_a_broken_one():
    from labkit.tricks import averaging
    good = _timeline(4, 12)
    assert averaging.schedule_check(good, 4, 12) == ([0, 4, 8], True)
    assert averaging.one_all_reduce_per_averaging(good, 4, n_params=100)[1]
    assert averaging.apart_between_averagings(good, 4) == (pytest.approx(0.2), True)
    assert averaging.divergence_grows_in_a_period(good, 4)[1]
    broken = _timeline(4, 12, skip=4)          # an averaging that sent nothing and left the ranks apart
    assert averaging.schedule_check(broken, 4, 12) == ([0, 8], False)
    assert not averaging.one_all_reduce_per_averaging(broken, 4, n_params=100)[1]
    flat = good.assign(divergence=0.3)         # a distance that does not grow through a period
    assert not averaging.divergence_grows_in_a_period(flat, 4)[1]
    assert not averaging.apart_between_averagings(good.assign(divergence=0.0), 4)[1]
