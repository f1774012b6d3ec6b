import math

import torch

import pytest

from labkit.training.lr import lr_at


def test_warmup_rises_linearly_to_the_peak():
    lrs = [lr_at(s, peak=1.0, steps=100, warmup_steps=4) for s in range(5)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_cosine_runs_from_peak_to_floor():
    lrs = [lr_at(s, peak=2.0, steps=11, schedule="cosine", min_lr_ratio=0.1) for s in range(11)]
    assert lrs[0] == pytest.approx(2.0) and lrs[-1] == pytest.approx(0.2)
    assert lrs[5] == pytest.approx(0.2 + 1.8 * 0.5)  # half way: the mean of peak and floor
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_linear_decay_and_constant():
    assert lr_at(10, peak=1.0, steps=11, schedule="linear") == pytest.approx(0.0)
    assert lr_at(5, peak=1.0, steps=11, schedule="linear") == pytest.approx(0.5)
    assert lr_at(7, peak=3.0, steps=11) == 3.0


def test_warmup_then_cosine_is_continuous_at_the_join():
    before = lr_at(9, peak=1.0, steps=50, warmup_steps=10, schedule="cosine")
    after = lr_at(10, peak=1.0, steps=50, warmup_steps=10, schedule="cosine")
    assert before == pytest.approx(1.0) and after == pytest.approx(1.0)
    assert math.isclose(lr_at(49, peak=1.0, steps=50, warmup_steps=10, schedule="cosine"), 0.0, abs_tol=1e-12)


def test_unknown_schedule_raises():
    with pytest.raises(ValueError, match="schedule"):
        lr_at(0, peak=1.0, steps=5, schedule="exp")


# --- transformers' schedules, called through transformers; plateau on real ranks -----------------------------

import labkit  # noqa: E402
from labkit import ConfigError, RunConfig  # noqa: E402
from labkit.tricks import schedules  # noqa: E402

HF = [dict(schedule="cosine_restarts", cycles=3, warmup_steps=5, steps=47),
      dict(schedule="cosine_restarts", cycles=1, warmup_steps=0, steps=20),
      dict(schedule="polynomial", poly_power=2.0, warmup_steps=4, steps=33, min_lr_ratio=0.1),
      dict(schedule="polynomial", poly_power=0.5, warmup_steps=0, steps=12)]


@pytest.mark.parametrize("fields", HF)
def test_each_transformers_schedule_equals_transformers_own_scheduler_at_every_step(fields):
    from labkit.training.lr import lr_for_config
    cfg = RunConfig(lr=3e-3, **fields)
    ours = [lr_for_config(s, cfg) for s in range(cfg.steps)]
    assert ours == schedules.reference_lrs(cfg)     # bit for bit, against LambdaLR stepped by an optimizer
    assert ours[0] == 0.0 if cfg.warmup_steps else ours[0] == pytest.approx(3e-3)


def test_restarts_return_to_the_peak_cycles_minus_one_times():
    cfg = RunConfig(lr=1.0, schedule="cosine_restarts", cycles=3, warmup_steps=4, steps=34)
    lrs = schedules.reference_lrs(cfg)
    ups = [s for s in range(cfg.warmup_steps + 1, cfg.steps) if lrs[s] > lrs[s - 1]]
    assert ups == [14, 24] and lrs[14] == lrs[24] == 1.0


def test_the_ranks_record_the_schedules_lr_at_every_step(runs_root):
    cfg = RunConfig(world_size=2, steps=12, tensorboard=False, save_final=False, schedule="cosine_restarts",
                    cycles=2, warmup_steps=3)
    run = labkit.launch(cfg, runs_root=runs_root, echo=False)
    assert schedules.lr_mismatch(run) == 0.0 and run.lr_disagreement() is None


@pytest.mark.parametrize("changes, says", [({"schedule": "plateau"}, "eval_every"),
                                           ({"schedule": "cosine_restarts", "min_lr_ratio": 0.1}, "decay to 0"),
                                           ({"schedule": "polynomial", "min_lr_ratio": 1.0}, "below 1"),
                                           ({"schedule": "plateau", "eval_every": 2, "plateau_factor": 1.0},
                                            "below 1"),
                                           ({"nan_policy": "pray"}, "stop, skip")])
def test_schedule_and_nan_policy_rules_name_the_field(changes, says):
    with pytest.raises(ConfigError, match=says):
        RunConfig(**changes)


PLATEAU = RunConfig(task="digits", world_size=2, steps=300, optimizer="sgd", lr=0.1, schedule="plateau",
                    eval_every=10, plateau_patience=2, tensorboard=False)


def test_plateau_on_the_all_reduced_loss_cuts_together_and_per_rank_losses_split_the_ranks(runs_root):
    shared = labkit.launch(PLATEAU, runs_root=runs_root, echo=False)
    assert shared.lr_disagreement() is None
    assert shared.df["lr"].min() < PLATEAU.lr                      # it did cut the LR, on every rank alike
    same = shared.final_state(0), shared.final_state(1)
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    buggy = labkit.launch(PLATEAU.replace(plateau_per_rank=True), runs_root=runs_root, echo=False)
    split = buggy.lr_disagreement()
    assert split is not None and split % PLATEAU.eval_every == 0   # right after an evaluation
    lrs = buggy.df[buggy.df["step"] == split].set_index("rank")["lr"]
    assert lrs[0] != lrs[1]
    before = buggy.df[buggy.df["step"] < split]
    assert before.groupby("step")["lr"].nunique().eq(1).all()
    apart = buggy.final_state(0), buggy.final_state(1)
    assert any(not torch.equal(apart[0][k], apart[1][k]) for k in apart[0])  # different LRs, different models


def test_heldout_shards_split_one_fixed_set_between_the_ranks():
    from labkit.training.plateau import HELDOUT_SENTENCES, heldout_batch
    from labkit.training.tasks import make_task
    task = make_task(RunConfig(world_size=2))
    whole, _ = heldout_batch(task, 0, 1)
    parts = [heldout_batch(task, r, 2)[0] for r in range(2)]
    assert whole.shape[0] == HELDOUT_SENTENCES and torch.equal(torch.cat(parts), whole)
    assert torch.equal(heldout_batch(make_task(RunConfig(world_size=2, seed=7)), 0, 1)[0], whole)  # not the seed's
    inputs, targets = heldout_batch(make_task(RunConfig(task="digits")), 1, 2)
    assert len(inputs) == len(targets) == 180
