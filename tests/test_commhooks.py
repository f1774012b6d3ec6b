"""Counting what DDP sends: the arithmetic, and real gloo runs of every hook."""
import pytest
import torch

import labkit
from labkit import RunConfig
from labkit.train.commhooks import CommCounter, powersgd_bytes, single_bucket_mb
from labkit.train.tasks import make_task


def test_counter_takes_and_resets():
    counter = CommCounter()
    counter.add(10)
    counter.add(6)
    assert counter.take() == (2, 16) and counter.take() == (0, 0)


def test_powersgd_payload_is_the_low_rank_factors_of_large_matrices_only():
    grads = [torch.zeros(100, 50), torch.zeros(50), torch.zeros(4, 4)]
    # 100x50 at rank 2: P 100x2 + Q 50x2 = 300 elements; the bias whole; 4x4 would not halve at rank 2: whole
    assert powersgd_bytes(grads, rank=2) == (300 + 50 + 16) * 4
    assert powersgd_bytes(grads, rank=2, compressing=False) == (5000 + 50 + 16) * 4


def test_single_bucket_holds_the_whole_model():
    model = torch.nn.Linear(1024, 1024)
    assert single_bucket_mb(model) > (1024 * 1024 + 1024) * 4 / 2**20


@pytest.fixture(scope="module")
def hook_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {hook: labkit.launch(RunConfig(world_size=2, steps=4, comm_hook=hook, tensorboard=False),
                                runs_root=root, echo=False)
            for hook in ("allreduce", "fp16", "bf16", "powersgd")}


def test_every_hook_trains_and_counts_its_payload(hook_runs):
    params = sum(p.numel() for p in make_task(RunConfig(world_size=2)).build_model().parameters())
    payload = {hook: run.df[run.df["rank"] == 0]["comm_bytes"].tolist() for hook, run in hook_runs.items()}
    assert payload["allreduce"] == [params * 4] * 4
    assert payload["fp16"] == payload["bf16"] == [params * 2] * 4
    assert payload["powersgd"][0] == params * 4 and payload["powersgd"][-1] < params * 4 / 10  # after warm-up
    for run in hook_runs.values():
        assert run.steps()["loss"].iloc[-1] < run.steps()["loss"].iloc[0]


def test_no_sync_all_reduces_once_per_step_and_the_naive_way_every_micro_batch(runs_root):
    base = RunConfig(world_size=2, global_batch=32, grad_accum=4, steps=3, tensorboard=False)
    synced = labkit.launch(base, runs_root=runs_root, echo=False)
    naive = labkit.launch(base.replace(no_sync=False), runs_root=runs_root, echo=False)
    assert synced.df["allreduces"].tolist() == [1] * 6 and naive.df["allreduces"].tolist() == [4] * 6
    # Same update either way: the gradients are averaged once, or four times over partial sums.
    assert naive.steps()["loss"].tolist() == pytest.approx(synced.steps()["loss"].tolist(), abs=1e-5)


def test_a_batch_over_the_memory_budget_fails_with_the_advice_to_accumulate(runs_root, no_leftovers):
    cfg = RunConfig(world_size=2, global_batch=1024, steps=2, memory_budget_mb=20, tensorboard=False)
    with pytest.raises(labkit.RankFailure) as info:
        labkit.launch(cfg, runs_root=runs_root, echo=False)
    assert "OutOfMemoryBudget" in info.value.detail and "grad_accum=2" in info.value.detail
    labkit.launch(cfg.replace(memory_budget_mb=None), runs_root=runs_root, echo=False)  # the same run, no budget
