import math

import pytest

import labkit
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
    ({"precision": "fp4"}, "precision"),
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


# --- every field is type-checked: arbitrary values either build a config that survives JSON, or name the field ---

import dataclasses  # noqa: E402
import json  # noqa: E402
import types  # noqa: E402
import typing  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from labkit.config import RULES  # noqa: E402

FIELDS = [f.name for f in dataclasses.fields(RunConfig)]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.integers(), st.floats(allow_nan=True),
                    st.text(max_size=8), st.binary(max_size=4), st.sampled_from(["tinylm", "digits", "sgd", "cosine",
                                                                                 "fp16", "gloo", "ddp", "raise"]))
ANY_VALUE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                         max_leaves=6)
FAULT_LIKE = st.one_of(ANY_VALUE, st.lists(st.one_of(
    st.fixed_dictionaries({"kind": st.sampled_from(["raise", "nan", "boom", 3]), "rank": ANY_VALUE,
                           "step": ANY_VALUE}),
    st.dictionaries(st.sampled_from(["kind", "rank", "step", "when"]), ANY_VALUE, max_size=4),
    st.builds(Fault, kind=st.sampled_from(["raise", "hang", "x"]), rank=st.integers(-1, 3), step=st.integers(-1, 30)),
    ANY_VALUE), max_size=3))


HINTS = typing.get_type_hints(RunConfig)


def _has_declared_type(value, hint) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_has_declared_type(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(isinstance(v, typing.get_args(hint)[0]) for v in value)
    raise AssertionError(f"no check for {hint}")


def _builds_or_names(build, fields):
    """Either a config whose every field has its declared type and that survives a JSON round trip, or a
    ConfigError naming one of `fields`."""
    try:
        cfg = build()
    except ConfigError as error:
        assert any(f"RunConfig.{name}" in str(error) for name in fields), str(error)
        return
    for name in FIELDS:
        assert _has_declared_type(getattr(cfg, name), HINTS[name]), (name, getattr(cfg, name))
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_every_field_has_a_rule():
    assert set(RULES) == set(FIELDS) - {"faults"}


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE, faults=FAULT_LIKE)
def test_any_value_in_any_field_builds_a_config_or_names_the_field(field, value, faults):
    _builds_or_names(lambda: RunConfig(**{field: value}), [field])
    _builds_or_names(lambda: RunConfig(faults=faults), ["faults"])


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.dictionaries(st.sampled_from(FIELDS), ANY_VALUE, max_size=5))
def test_from_dict_builds_a_config_or_names_a_field(data):
    _builds_or_names(lambda: RunConfig.from_dict(data), list(data))


@pytest.mark.parametrize("changes", [{"deterministic": 7}, {"pin_memory": b"x"}, {"name": object()},
                                     {"faults": "raise"}, {"faults": [{"kind": "raise", "step": 1}]},
                                     {"faults": [{"kind": "raise", "rank": "0", "step": 1}]}])
def test_the_wrong_types_a_user_met_are_named(changes):
    field = next(iter(changes))
    with pytest.raises(ConfigError, match=rf"RunConfig\.{field}"):
        RunConfig.from_dict(changes) if field == "faults" else RunConfig(**changes)


def test_a_config_recorded_by_an_older_labkit_still_loads(tmp_path):
    old = RunConfig(world_size=2).to_dict()
    old.pop("nan_policy")
    old.update(stop_on_nan=False, retired_field=3)
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "meta.json").write_text("{}")
    with pytest.warns(UserWarning, match="retired_field"):
        cfg = labkit.load_run(tmp_path).config
    assert cfg.nan_policy == "ignore" and cfg.world_size == 2
    with pytest.raises(ConfigError, match="retired_field"):
        RunConfig.load(tmp_path / "config.json")  # a config a person wrote: an unknown field is a mistake


def test_checkpoint_fields_and_dropout_are_checked():
    assert RunConfig(checkpoint_every=5, checkpoint_keep=1, checkpoint_format="dcp", dropout=0.1).checkpoint_every == 5
    for changes, field in (({"checkpoint_every": -1}, "checkpoint_every"), ({"checkpoint_keep": 0}, "checkpoint_keep"),
                           ({"checkpoint_format": "pickle"}, "checkpoint_format"), ({"dropout": 1.0}, "dropout")):
        with pytest.raises(ConfigError, match=rf"RunConfig\.{field}"):
            RunConfig(**changes)
    with pytest.raises(ConfigError, match="dropout exists for task 'tinylm' only"):
        RunConfig(task="digits", dropout=0.1)
