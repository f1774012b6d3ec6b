import math

import pytest

from labkit import ConfigError, Fault, RunConfig


def test_defaults_are_valid_and_batch_splits():
    cfg = RunConfig(world_size=2, global_batch=32, grad_accum=2)
    assert cfg.batch_per_rank == 8


def test_per_rank_builds_the_global_batch():
    cfg = RunConfig.per_rank(batch_per_rank=16, world_size=4, grad_accum=2)
    assert cfg.global_batch == 128 and cfg.batch_per_rank == 16


@pytest.mark.parametrize("changes, field", [
    ({"world_size": 0}, "world_size"),
    ({"world_size": 1.5}, "world_size"),
    ({"world_size": True}, "world_size"),
    ({"lr": float("nan")}, "lr"),
    ({"lr": -1e-3}, "lr"),
    ({"lr": 0.0}, "lr"),
    ({"task": "imagenet"}, "task"),
    ({"optimizer": "lamb"}, "optimizer"),
    ({"schedule": "step"}, "schedule"),
    ({"precision": "fp8"}, "precision"),
    ({"backend": "ucc"}, "backend"),
    ({"clip_norm": 0.0}, "clip_norm"),
    ({"clip_norm": math.inf}, "clip_norm"),
    ({"steps": 0}, "steps"),
    ({"branching": 100, "vocab_size": 64}, "branching"),
    ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
])
def test_bad_values_are_rejected_with_the_field_and_value(changes, field):
    with pytest.raises(ConfigError) as info:
        RunConfig(**changes)
    message = str(info.value)
    assert f"RunConfig.{field} = " in message
    assert repr(changes[field]) in message or str(changes[field]) in message


def test_batch_that_does_not_split_names_the_sizes_and_a_fix():
    with pytest.raises(ConfigError) as info:
        RunConfig(world_size=4, global_batch=30)
    message = str(info.value)
    assert "global_batch = 30" in message and "world_size=4" in message and "multiple of 4" in message


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as info:
        RunConfig(world_size=0, lr=float("nan"), task="x")
    assert str(info.value).count("RunConfig.") == 3


def test_faults_are_checked_against_world_and_steps():
    with pytest.raises(ConfigError, match=r"Fault.rank = 2"):
        RunConfig(world_size=2, faults=(Fault(kind="raise", rank=2, step=0),))
    with pytest.raises(ConfigError, match=r"Fault.kind = 'explode'"):
        RunConfig(faults=(Fault(kind="explode", rank=0, step=0),))
    with pytest.raises(ConfigError, match=r"Fault.step = 20"):
        RunConfig(steps=20, faults=(Fault(kind="hang", rank=0, step=20),))


def test_replace_validates_and_json_round_trips(tmp_path):
    cfg = RunConfig(world_size=2, faults=(Fault(kind="nan", rank=1, step=3),), clip_norm=1.0)
    with pytest.raises(ConfigError):
        cfg.replace(world_size=-1)
    cfg.save(tmp_path / "c.json")
    assert RunConfig.load(tmp_path / "c.json") == cfg


def test_unknown_fields_in_json_are_named():
    with pytest.raises(ConfigError, match="wrold_size"):
        RunConfig.from_dict({"wrold_size": 2})
