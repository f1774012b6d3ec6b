"""torchao's FP8 training beside labkit's simulation (lesson 20, section 3b; RunConfig.fp8_engine = "torchao").

torchao's Float8Linear multiplies through torch._scaled_mm on FP8 tensors; labkit's simulation dequantises and
multiplies in fp32. At the same recipe they must compute the same numbers, and a recipe that differs must not."""
import copy
import importlib.util

import pytest
import torch
from torch import nn

from labkit import ConfigError, RunConfig, launch
from labkit.tricks import fp8
from labkit.training.fp8 import relative_error
from labkit.training.fp8_layers import apply_fp8, torchao_config
from labkit.training.fp8_linear import Recipe, fp8_linear
from labkit.training.tasks import make_task

needs_torchao = pytest.mark.skipif(not fp8.torchao_available(),
                                   reason="torchao is not installed (pip install 'labkit[fp8]')")


def _one_layer(recipe: Recipe, torchao_recipe: Recipe, shape=(48, 32, 24), seed=0):
    """Forward and backward of one Linear in labkit's simulation (recipe) and in torchao (torchao_recipe):
    the relative gaps of y, dx, dW."""
    from torchao.float8 import convert_to_float8_training

    m, k, n = shape
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
    theirs = convert_to_float8_training(nn.Sequential(copy.deepcopy(layer)), config=torchao_config(torchao_recipe))
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)   # columns of very different sizes
    dy = torch.randn(m, n, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = fp8_linear(x1, layer.weight, None, recipe)
    y1.backward(dy)
    y2 = theirs(x2)
    y2.backward(dy)
    return (relative_error(y1, y2), relative_error(x1.grad, x2.grad),
            relative_error(layer.weight.grad, theirs[0].weight.grad))


@needs_torchao
@pytest.mark.parametrize("scaling, grad_format", [("tensor", "e5m2"), ("tensor", "e4m3"), ("row", "e4m3"),
                                                  ("row", "e5m2")])
@pytest.mark.parametrize("shape", [(48, 32, 24), (7, 40, 16), (64, 8, 32)])
def test_one_layer_equals_torchao_forward_and_backward(scaling, grad_format, shape):
    recipe = Recipe(scaling, 8, grad_format)
    assert max(_one_layer(recipe, recipe, shape)) < 1e-6


@needs_torchao
@pytest.mark.parametrize("ours, theirs", [("tensor", "row"), ("row", "tensor")])
def test_a_different_recipe_is_told_apart(ours, theirs):
    """The equality above can fail: per tensor against per row differs by far more than 1e-6."""
    assert max(_one_layer(Recipe(ours, 8, "e4m3"), Recipe(theirs, 8, "e4m3"))) > 1e-3


@needs_torchao
def test_rowwise_needs_labkits_bf16_output_rounding():
    """torchao writes a rowwise GEMM's output in bf16: labkit's "row" without that rounding would be 1e-3 apart."""
    recipe = Recipe("row", 8, "e4m3")
    unrounded = Recipe("row", 8, "e4m3")
    object.__setattr__(unrounded, "product", lambda a, b: a @ b)   # the same casts, the product kept in fp32
    assert max(_one_layer(unrounded, recipe)) > 1e-4
    assert max(_one_layer(recipe, recipe)) < 1e-6


# fp8.torchao_check (both recipes against the simulation: layers converted, 3 _scaled_mm per layer and step, none of
# labkit's, the experts kept, losses and gradients within 1e-6, the loss falling) is run and checked by lesson 20's
# claims under make test.


@needs_torchao
def test_the_engine_switches_the_linear_layers_and_keeps_the_rest_in_labkits_simulation():
    config = fp8.lesson_config(task="tinymoe", precision="fp8", fp8_engine="torchao", fp8_scaling="row")
    model = make_task(config, 1).build_model()
    done = apply_fp8(model, config)
    kinds = {type(model.get_submodule(name)).__name__ for name in done["layers"]}
    assert kinds == {"Float8Linear", "FP8Experts"} and len(done["torchao"]) == 16
    assert type(model.get_output_embeddings()) is nn.Linear   # the head stays
    assert set(model.state_dict()) == set(make_task(config, 1).build_model().state_dict())


@needs_torchao
def test_runconfig_trains_on_torchao_across_ranks_as_on_the_simulation(tmp_path):
    runs = {engine: launch(RunConfig(task="tinymoe", world_size=2, global_batch=16, steps=3, precision="fp8",
                                     fp8_scaling="row", fp8_engine=engine, tensorboard=False, save_final=False,
                                     name=engine), runs_root=tmp_path, echo=False, progress=False)
            for engine in ("labkit", "torchao")}
    ours, theirs = (runs[e].df["loss"].to_numpy() for e in ("labkit", "torchao"))   # per (step, rank)
    assert len(ours) == 6 and abs(ours - theirs).max() <= 1e-6 * abs(ours).max()
    assert runs["torchao"].config.fp8_engine == "torchao"


def test_without_torchao_the_engine_is_refused_with_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert not fp8.torchao_available()
    with pytest.raises(ConfigError, match=r"pip install 'labkit\[fp8\]'"):
        RunConfig(task="tinymoe", precision="fp8", fp8_scaling="row", fp8_engine="torchao")


@pytest.mark.parametrize("fields, says", [
    ({"task": "tinylm", "fp8_scaling": "row"}, "Conv1D"),
    ({"task": "tinymoe", "fp8_scaling": "tile"}, "Triton"),
])
def test_what_torchao_cannot_take_is_refused_saying_why(fields, says):
    with pytest.raises(ConfigError, match=says):
        RunConfig(precision="fp8", fp8_engine="torchao", **fields)
