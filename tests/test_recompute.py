"""RunConfig.recompute (training/parallel/recompute.py) on real gloo ranks: the same numbers, the activations the
formula gives for a block that keeps its input only, under DDP and FSDP2; refusals; the state dict unchanged."""
import pytest
import torch

import labkit
from labkit import ConfigError, RunConfig
from labkit.training.parallel.recompute import recompute_blocks
from labkit.training.tasks import make_task
from labkit.tricks import parallel, tpclaim

STEPS = 3


def config(strategy, world=2, **fields):
    return parallel.lesson_config(strategy, world, steps=STEPS, tensorboard=False, save_final=False, **fields)


def launch(cfg, root):
    return labkit.launch(cfg, runs_root=root, echo=False, progress=False)


def losses(run):
    return run.df.sort_values(["step", "rank"])["loss"].tolist()


def test_recomputation_trains_the_same_numbers_and_keeps_the_formulas_activations(runs_root, no_leftovers):
    runs = {how: launch(config("ddp", recompute=how, name=f"ddp {how}"), runs_root) for how in ("none", "full")}
    assert losses(runs["full"]) == losses(runs["none"])           # bit for bit: the same forward, run twice
    for how, run in runs.items():
        held = parallel.held(run)["activations"]
        predicted = tpclaim.predicted_activations(run.config)
        assert abs(held - predicted) <= 0.01 * predicted, (how, held, predicted)
    assert parallel.held(runs["none"])["activations"] > 5 * parallel.held(runs["full"])["activations"]


def test_with_dropout_the_recomputed_forward_draws_the_same_masks(runs_root, no_leftovers):
    runs = [launch(config("ddp", recompute=how, dropout=0.1, name=f"dropout {how}"), runs_root)
            for how in ("none", "full")]
    assert losses(runs[0]) == losses(runs[1])


def test_under_fsdp2_recomputation_trains_as_ddp_does(runs_root, no_leftovers):
    ddp = launch(config("ddp", name="ddp"), runs_root)
    fsdp = launch(config("fsdp", recompute="full", name="fsdp full"), runs_root)
    assert max(abs(a - b) for a, b in zip(losses(ddp), losses(fsdp))) < 1e-5
    held = parallel.held(fsdp)["activations"]
    assert abs(held - tpclaim.predicted_activations(fsdp.config)) <= 0.01 * held


def test_the_wrapped_model_keeps_its_state_dict_keys_and_values():
    cfg = RunConfig(task="tinylm", world_size=1, global_batch=4)
    plain, wrapped = (make_task(cfg, 1).build_model() for _ in range(2))
    wrapped.load_state_dict(plain.state_dict())
    assert recompute_blocks(wrapped, "full") == len(plain.transformer.h)
    assert list(wrapped.state_dict()) == list(plain.state_dict())   # a checkpoint loads either way
    plain.load_state_dict(wrapped.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    assert recompute_blocks(plain, "none") == 0
    with pytest.raises(ValueError, match="recompute = 'some'"):
        recompute_blocks(plain, "some")
    with pytest.raises(ValueError, match="no .transformer.h"):
        recompute_blocks(torch.nn.Linear(2, 2), "full")


@pytest.mark.parametrize("fields, words", [
    ({"task": "digits"}, "recomputes tinylm's GPT-2 blocks"),
    ({"strategy": "pp", "pipeline_ranks": 2, "layers": 2}, "not with RunConfig.strategy = 'pp'"),
    ({"context_parallel": 2}, "not with RunConfig.context_parallel = 2"),
    ({"recompute": "selective"}, "recompute"),
])
def test_recomputation_is_refused_where_it_does_not_apply(fields, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig(**{"task": "tinylm", "world_size": 2, "global_batch": 8, "recompute": "full", **fields}).validate()
