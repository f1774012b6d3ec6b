"""held.SavedTensors: what autograd keeps for backward, counted only while it is held (pure, one process)."""
import torch
from torch import nn

from labkit.training.parallel.held import SavedTensors


def forward_with_a_dead_branch(x: torch.Tensor) -> torch.Tensor:
    h = x * 1.0                 # not a leaf: an activation
    (h + 1.0).sin()             # a branch nothing uses: autograd frees what it saved as soon as it is dropped
    return h.cos()              # saves h


def test_a_dropped_branch_is_not_counted_and_the_held_one_is():
    x = torch.randn(64, 32, requires_grad=True)
    with SavedTensors() as saved:
        out = forward_with_a_dead_branch(x)
    assert saved.bytes() == 64 * 32 * 4         # h only; counting by address alone would add the sin's input
    del out
    assert saved.bytes() == 0                   # the graph is gone, and with it what it saved


def test_weights_are_model_state_not_activations():
    layer = nn.Linear(32, 16)
    x = torch.randn(8, 32)
    with SavedTensors() as saved:
        out = layer(x)
    assert out.grad_fn is not None
    assert saved.bytes() == 8 * 32 * 4          # the input it saved; the weight it saved is model state


def test_labels_name_the_innermost_module_and_leave_the_output_alone():
    model = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(8, 32, requires_grad=True)
    with SavedTensors(modules=model) as saved:
        out = model(x)
    assert isinstance(out, torch.Tensor) and out.shape == (8, 4)   # a forward hook that returned a value replaces it
    labels = dict(saved.held())
    assert set(labels) == {"1", "2"}            # GELU saves its input, the second Linear its input (GELU's output)
    assert labels["1"] == labels["2"] == 8 * 16 * 4
    assert model._forward_hooks == {} and model[0]._forward_pre_hooks == {}   # unhooked on leaving
