"""Seeds: what is shared across ranks, what is per rank, and runs that repeat bit for bit."""
import importlib
import random

import numpy as np
import pandas as pd
import pytest
import torch

import labkit
from labkit import RunConfig
from labkit.training.seeding import determinism_switches, rank_seed, rng_fingerprint, seed_everything

# Fields that measure the machine, not the computation: they differ between any two runs.
TIMING_FIELDS = {"time", "t_data", "t_fwd_bwd", "t_optim", "t_step", "rss_mb", "peak_growth_mb"}


def test_the_same_seed_gives_the_same_streams_and_rank_seeds_differ():
    seed_everything(7)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    seed_everything(7)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    assert len({rank_seed(7, r) for r in range(64)}) == 64 and rank_seed(7, 1) == rank_seed(7, 1)
    seed_everything(7, rank=1)
    one = rng_fingerprint()
    seed_everything(7, rank=2)
    assert rng_fingerprint() != one


def test_bad_seeds_are_rejected():
    with pytest.raises(ValueError, match="seed = -1"):
        seed_everything(-1)


def _computed(run):
    columns = [c for c in run.df.columns if c not in TIMING_FIELDS]
    return run.df[columns]


def test_two_seeded_runs_produce_identical_records_field_by_field(runs_root):
    cfg = RunConfig(task="digits", world_size=2, steps=6, eval_every=3, tensorboard=False)
    a, b = (labkit.launch(cfg, runs_root=runs_root, echo=False) for _ in range(2))
    assert len(a.df) == 12
    pd.testing.assert_frame_equal(_computed(a), _computed(b), check_exact=True)  # bit for bit; NaN where NaN
    other = labkit.launch(cfg.replace(seed=1), runs_root=runs_root, echo=False)
    assert _computed(other)["loss"].tolist() != _computed(a)["loss"].tolist()


def train_then_read_switches(ctx):
    labkit.train(ctx)
    return determinism_switches()


def test_deterministic_true_takes_effect_inside_the_ranks_and_a_no_op_switch_is_caught(runs_root, monkeypatch):
    cfg = RunConfig(task="digits", world_size=2, steps=2, tensorboard=False, save_final=False)
    strict = labkit.launch(train_then_read_switches, config=cfg.replace(deterministic=True), runs_root=runs_root,
                           echo=False)
    plain = labkit.launch(train_then_read_switches, config=cfg, runs_root=runs_root, echo=False)
    assert [strict.result(r)["deterministic_algorithms"] for r in range(2)] == [True, True]
    assert [plain.result(r)["deterministic_algorithms"] for r in range(2)] == [False, False]
    assert strict.result(0)["cudnn.benchmark"] is False and strict.result(0)["CUBLAS_WORKSPACE_CONFIG"]
    # A switch that does nothing: lesson 08's assert, read inside the ranks, now fails.
    monkeypatch.setattr(importlib.import_module("labkit.training.loop"), "set_deterministic", lambda enabled=True: None)
    broken = labkit.launch(train_then_read_switches, config=cfg.replace(deterministic=True), runs_root=runs_root,
                           echo=False)
    assert not any(broken.result(r)["deterministic_algorithms"] for r in range(2))


def test_agreement_counts_equal_positions_and_refuses_other_shapes():
    from labkit.tricks import seeds
    a = torch.tensor([True, False, True, False])
    assert seeds.agreement(a, a) == 1.0 and seeds.agreement(a, ~a) == 0.0
    assert seeds.agreement(a, torch.tensor([True, True, True, True])) == 0.5
    with pytest.raises(ValueError, match="shapes"):
        seeds.agreement(a, a[:2])


def test_the_streams_figure_draws_one_lane_per_rank():
    from labkit.tricks import seeds
    fig = seeds.streams_figure(world_size=3)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [t for t in texts if t.startswith("rank ")] == ["rank 0", "rank 1", "rank 2"]
    assert sum("rank_seed(1234, 2)" in t for t in texts) == 1
