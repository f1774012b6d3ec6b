"""The digits DataLoader pipeline: the rows of in-memory slicing, deterministic per-sample work, workers that end."""
import time

import pandas as pd
import psutil
import pytest
import torch

import labkit
from labkit import Fault, RunConfig
from labkit.measure import CpuMeter, interleaved
from labkit.measure.timing import metered
from labkit.training.data import DigitsSamples, DigitsStream, StepBatchSampler, digits_data, sample_work
from labkit.tricks import loading
from labkit.tricks.loading import epoch_starts, predicted_step, split_table, step_split
from labkit.training.tasks import make_task

from .conftest import leftover_processes

BASE = RunConfig(task="digits", world_size=1, global_batch=64, steps=30, tensorboard=False, save_final=False)


@pytest.mark.parametrize("world, accum", [(1, 1), (2, 1), (2, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("workers, cost", [(0, 0.05), (2, 0.0)])
def test_the_loader_delivers_the_rows_of_in_memory_slicing(world, accum, workers, cost, no_leftovers):
    memory = make_task(BASE.replace(world_size=world, grad_accum=accum))
    loaded = make_task(BASE.replace(world_size=world, grad_accum=accum, data_workers=workers, sample_cost_ms=cost))
    # steps 21-23 cross the end of the first loader epoch (1437 // 64 = 22 steps) and of the first pass over the
    # 1437 images (a new shuffle starts inside step 22); asked for out of order, the stream seeks
    for rank in range(world):
        for step in (0, 21, 22, 23):
            for micro in range(accum):
                x, y = loaded.batch(step, micro, rank)
                x0, y0 = memory.batch(step, micro, rank)
                assert torch.equal(x, x0) and torch.equal(y, y0), (rank, step, micro)
    loaded.close()


def test_the_stream_in_loop_order_covers_every_step_and_stops_its_workers(no_leftovers):
    cfg = BASE.replace(world_size=2, grad_accum=2, steps=25, data_workers=2)
    memory, stream = make_task(cfg.replace(data_workers=0)), DigitsStream(cfg, world_size=2, rank=1)
    for step in range(cfg.steps):
        for micro in range(cfg.grad_accum):
            x, y = stream.batch(step, micro)
            assert torch.equal(y, memory.batch(step, micro, 1)[1])
        if step == 3:
            assert len(leftover_processes()) == 2, "two workers while the run goes"
    assert stream.epochs_started == 2          # 25 steps of 64: one loader epoch of 22 steps, then the rest
    assert leftover_processes() == [], "the workers stop after the run's last batch"


def test_persistent_workers_are_started_once_and_deliver_the_same_rows(no_leftovers):
    cfg = BASE.replace(global_batch=256, steps=12, data_workers=2, persistent_workers=True, prefetch_factor=1)
    memory, stream = make_task(cfg.replace(data_workers=0, persistent_workers=False)), DigitsStream(cfg, 1, 0)
    pids = set()
    for step in range(cfg.steps):
        x, y = stream.batch(step)
        assert torch.equal(x, memory.batch(step, 0, 0)[0])
        pids |= {p.pid for p in leftover_processes()}
    assert stream.epochs_started == 3 and len(pids) == 2  # 3 epochs of 5 steps (the last cut short), 2 processes


def test_the_global_batch_is_the_same_whatever_the_split_with_the_loader(no_leftovers):
    def global_batch(cfg, step):
        task = make_task(cfg)
        parts = [task.batch(step, m, r) for m in range(cfg.grad_accum) for r in range(cfg.world_size)]
        task.close()
        return torch.cat([p[1] for p in parts])

    a = global_batch(BASE, 5)
    b = global_batch(BASE.replace(world_size=4, grad_accum=2, data_workers=1), 5)
    assert torch.equal(a, b)


def test_sample_work_is_deterministic_and_costs_the_cpu_time_asked_for():
    images = digits_data()[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = sample_work(images[3], seed=0, position=11, cost_ms=0.5)
        assert torch.equal(a, sample_work(images[3], seed=0, position=11, cost_ms=2.0))  # the cost is not the warp
        assert not torch.equal(a, sample_work(images[3], seed=0, position=12, cost_ms=0.5))
        assert not torch.equal(a, sample_work(images[3], seed=1, position=11, cost_ms=0.5))
        assert a.shape == (64,) and 0 <= a.min() and a.max() <= 1
        started = time.thread_time()
        for position in range(20):
            sample_work(images[position], seed=0, position=position, cost_ms=2.0)
        per_sample_ms = (time.thread_time() - started) / 20 * 1e3
        assert 2.0 <= per_sample_ms < 3.0, per_sample_ms
    finally:
        torch.set_num_threads(threads)


def test_the_dataset_hands_back_the_image_unless_asked_to_augment():
    images, labels = digits_data()[:2]
    plain = DigitsSamples(images, labels, seed=0, cost_ms=0.1)
    warped = DigitsSamples(images, labels, seed=0, cost_ms=0.1, augment=True)
    x, y, position = plain[(5, 1000)]
    assert torch.equal(x, images[5]) and y == labels[5] and position == 1000
    w, _, _ = warped[(5, 1000)]
    assert not torch.equal(w, images[5]) and torch.equal(w, warped[(5, 1000)][0])


def test_the_sampler_yields_the_rows_of_each_micro_batch_from_where_it_is_told():
    sampler = StepBatchSampler(seed=0, n=1437, global_batch=32, world_size=2, grad_accum=2, rank=1)
    sampler.set_steps(3, 5, micro=1)
    keys = list(sampler)
    assert len(keys) == len(sampler) == 3          # (3, 1), (4, 0), (4, 1)
    assert [k[0][1] for k in keys] == [3 * 32 + 24, 4 * 32 + 8, 4 * 32 + 24]   # positions: rows (m * 2 + 1) * 8
    assert all(len(k) == 8 for k in keys)


def test_the_loader_model_never_beats_the_cores_and_overlaps_compute():
    assert predicted_step(0, 2, data_ms=32, compute_ms=3)["ms per step"] == 35      # one after the other
    assert predicted_step(1, 2, data_ms=32, compute_ms=3)["ms per step"] == 32      # the worker hides compute
    assert predicted_step(2, 2, data_ms=32, compute_ms=3)["ms per step"] == 17.5    # both cores, no better
    assert predicted_step(8, 2, data_ms=32, compute_ms=3)["ms per step"] == 17.5
    assert predicted_step(8, 32, data_ms=32, compute_ms=3) == {"workers": 8, "cores": 32, "ms per step": 4.0,
                                                               "ms waiting for data": 1.0}


def test_a_launch_with_workers_records_t_data_trains_the_same_and_leaves_nothing(runs_root, no_leftovers):
    cfg = RunConfig(task="digits", world_size=2, global_batch=32, steps=8, tensorboard=False, save_final=False)
    with CpuMeter() as meter:
        loaded = labkit.launch(cfg.replace(data_workers=2, sample_cost_ms=0.2), runs_root=runs_root, echo=False,
                               progress=False)
    assert leftover_processes() == []
    plain = labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False)
    assert (loaded.df["t_data"] > 0).all() and len(loaded.df) == 16
    assert loaded.steps()["loss"].tolist() == plain.steps()["loss"].tolist()  # the same samples, bit for bit
    split = step_split(loaded, warmup=2)
    assert split["t_data"] > 0 and split["t_step"] >= split["t_data"]
    ours, others = metered(loaded, meter, warmup=2)
    assert 0 < ours < psutil.cpu_count() + 0.5 and others >= 0
    starts = epoch_starts({"loaded": loaded}, steps_per_epoch=4).loc["loaded"]
    assert starts["whole run (s)"] == pytest.approx(loaded.df.groupby("step")["t_step"].max().sum())
    assert starts["run's first step (ms)"] == pytest.approx(1e3 * loaded.df[loaded.df.step == 0]["t_data"].max())
    epoch_start = loaded.df[loaded.df.step == 4]["t_data"].max()              # step 4: the second epoch begins
    assert starts["epoch's first step (ms, median)"] == pytest.approx(1e3 * epoch_start)


def test_the_split_table_has_the_parts_in_ms_and_the_meter_per_setting(runs_root, no_leftovers):
    cfg = RunConfig(task="digits", world_size=1, global_batch=32, steps=8, sample_cost_ms=0.2, tensorboard=False,
                    save_final=False)
    timed = interleaved({"0 workers": cfg, "1 worker": cfg.replace(data_workers=1)}, rounds=1,
                        cores=1, warmup=2, runs_root=runs_root)
    table = split_table(timed)
    assert list(table.index) == ["0 workers", "1 worker"]
    row, split = table.loc["1 worker"], step_split(timed["1 worker"].run, warmup=2)
    assert row["t_data_ms"] == pytest.approx(1e3 * split["t_data"])
    assert row["samples/s"] == pytest.approx(32 / split["t_step"])
    assert row["cores busy"] == timed["1 worker"].ours and row["others' cores"] == timed["1 worker"].others
    assert row["t_cpu_ms"] == pytest.approx(row["t_step_ms"] * row["cores busy"])


def test_a_rank_that_fails_takes_its_workers_with_it(runs_root, no_leftovers):
    cfg = RunConfig(task="digits", world_size=2, global_batch=32, steps=8, data_workers=2, sample_cost_ms=0.1,
                    faults=(Fault(kind="raise", rank=1, step=3),), tensorboard=False, save_final=False)
    with pytest.raises(labkit.RankFailure) as failure:
        labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False)
    assert (failure.value.rank, failure.value.step) == (1, 3)
    assert leftover_processes() == []


# --- the lesson's claims: what a learner's loader returned, and the checks handed to the speed gate -----------------

def test_the_shards_cover_each_epoch_once_and_the_workers_are_told_apart():
    rank0 = [(0, 0, 11), (0, 2, 12), (1, 3, 11), (1, 1, 12)]
    rank1 = [(0, 1, 21), (0, 3, 22), (1, 0, 21), (1, 2, 22)]
    assert loading.shards_cover_once([rank0, rank1], size=4) == ("2 epochs, 2/2 samples per rank of 4", True)
    assert not loading.shards_cover_once([rank0, rank0], size=4)[1]                    # overlap, and 1 and 3 missing
    assert not loading.shards_cover_once([rank0, rank1 + [(1, 0, 21)]], size=4)[1]   # a sample twice in epoch 1
    assert not loading.shards_cover_once([[], []], size=4)[1]
    assert loading.epoch_orders(rank0) == [[0, 2], [3, 1]]
    assert loading.worker_pids(rank0) == [{11, 12}, {11, 12}]
    assert loading.made_by_workers({"rank pid": 10, "seen": rank0}, workers=2)[1]
    assert not loading.made_by_workers({"rank pid": 11, "seen": rank0}, workers=2)[1]   # the rank made some
    assert not loading.made_by_workers({"rank pid": 10, "seen": rank0}, workers=3)[1]


def test_the_gated_checks_assert_on_the_split_table_and_say_what_they_measured(monkeypatch):
    table = pd.DataFrame({"cores busy": [1.0, 1.9], "t_data_ms": [30.0, 12.0], "t_step_ms": [34.0, 18.0]})
    monkeypatch.setattr(loading, "split_table", lambda timed: table)
    assert loading.busy_below(2.0)(None) == "1.90 cores busy"
    two_cores = type("Timed", (), {"settings": {"cores": 2}})()
    assert loading.busy_above(0.9)(two_cores) == "1.00 cores busy"
    assert loading.ratio_below("t_data_ms", 0.75)(None) == "t_data_ms 0.40x"
    assert loading.ratio_above("t_step_ms", 0.5)(None) == "t_step_ms 0.53x"
    assert loading.busy_gain_below(1.0)(None) == "+0.90 cores busy (1.00 -> 1.90)"
    for check in (loading.busy_below(1.5), loading.busy_gain_below(0.5), loading.busy_above(1.5), loading.ratio_below("t_step_ms", 0.5),
                  loading.ratio_above("t_data_ms", 0.5)):
        with pytest.raises(AssertionError):
            check(two_cores)


def test_saves_under_compares_what_two_knobs_save_on_each_settings_median_over_rounds():
    from labkit.measure import Timing, Timings
    steps = {"0 workers": [0.040] * 3, "1 worker": [0.036, 0.034, 0.090], "2 workers": [0.020, 0.022, 0.021], "3 workers": [0.019, 0.018, 0.020],
             "prefetch 4": [0.0195, 0.0205, 0.020]}      # a disturbed round (0.090) moves no median
    timed = Timings({k: Timing(k, None, min(v), 1.0, 0.0, tuple((0.0, x) for x in v)) for k, v in steps.items()},
                    {k: None for k in steps}, {"rounds": 3, "cores": 2, "warmup": 4})
    assert loading.median_step_ms(timed["1 worker"]) == pytest.approx(36.0)
    assert loading.saved_share(timed, ("2 workers", "3 workers"), ("1 worker", "2 workers")) == pytest.approx(2 / 15)
    said = loading.saves_under(0.5, [("2 workers", "3 workers"), ("2 workers", "prefetch 4")],
                               ("1 worker", "2 workers"))(timed)
    assert said == "2 workers -> 3 workers saved 0.13, 2 workers -> prefetch 4 saved 0.07 of the 15.0 ms 1 worker -> 2 workers saved"
    with pytest.raises(AssertionError, match="saved 0.13 of what"):
        loading.saves_under(0.1, [("2 workers", "3 workers")], ("1 worker", "2 workers"))(timed)
    with pytest.raises(AssertionError, match="saved no step time"):       # a reference that saved nothing
        loading.saves_under(0.5, [("1 worker", "2 workers")], ("2 workers", "1 worker"))(timed)
    assert loading.extra_worker_unchecked(timed, 2).startswith("this run: worker 3 saved 0.13 of what worker 2 saved")


def test_the_restart_checks_read_the_epoch_starts(monkeypatch):
    starts = pd.DataFrame({"run's first step (ms)": [60.0, 50.0], "epoch's first step (ms, median)": [40.0, 8.0]},
                          index=["persistent_workers=False", "persistent_workers=True"])
    monkeypatch.setattr(loading, "epoch_starts", lambda runs, steps_per_epoch: starts)
    timed = type("Timed", (), {"runs": {}})()
    assert loading.restarts_cost(5)(timed) == "32 ms per epoch start"
    assert loading.persistent_pays_once(5)(timed) == "first step 50 ms, later epochs' 8 ms"
    with pytest.raises(AssertionError):
        loading.restarts_cost(5, ms=40)(timed)
    with pytest.raises(AssertionError):
        loading.persistent_pays_once(5, ms=45)(timed)


def test_pytorch_says_so_when_there_is_nothing_to_pin_for_and_warns_of_too_many_workers():
    if torch.accelerator.is_available():
        pytest.skip("with an accelerator the batch is pinned (and pinning here would initialise it)")
    pinned, said = loading.pinned_batch(BASE)
    assert not pinned and "no accelerator is found" in said
    log = "x\n.../dataloader.py:626: UserWarning: This DataLoader will create 3 worker processes in total. Our " \
          "suggested max number of worker in current system is 2\ny"
    run = type("Run", (), {"log": lambda self, rank: log})()
    assert loading.worker_warning(run).startswith("This DataLoader will create 3 worker processes")
    assert loading.worker_warning(type("Run", (), {"log": lambda self, rank: "quiet"})()) == ""


def test_the_digits_table_is_sklearns_load_digits_read_without_importing_sklearn():
    import subprocess
    import sys
    code = ("import sys; from labkit.training.data import digits_table; p, l = digits_table(); "
            "print(p.shape, l.shape, 'sklearn' in sys.modules)")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert said.strip() == "(1797, 64) (1797,) False"
    from sklearn.datasets import load_digits
    from labkit.training.data import digits_table
    pixels, labels = digits_table()
    digits = load_digits()
    assert (pixels == digits.data).all() and (labels == digits.target).all()
