"""What an optimizer object holds besides the parameters: its state tensors, found by walking the object.

    held = state_holdings(optimizer, model.parameters())
    held.bytes                  # bytes of state tensors (exp_avg, exp_avg_sq, step, ...) this rank keeps
    held.owned                  # indices (in the order given) of the parameters that have state here

The walk follows the optimizer's attributes, dicts, lists and any optimizer inside it (a sharded optimizer keeps
a local one), so it measures a hand-written ZeRO, torch's ZeroRedundancyOptimizer and a plain optimizer alike.
Tensors that are parameters, or their gradients, are not state; each storage is counted once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

MAX_DEPTH = 8


@dataclass(frozen=True)
class Holdings:
    """Optimizer state one rank holds: bytes, and which parameters (by position) it holds state for."""

    bytes: int
    owned: tuple[int, ...]
    owned_elements: int


def state_holdings(optimizer: Any, params: Iterable[torch.Tensor]) -> Holdings:
    """Walk `optimizer` and measure the state it holds for `params` (see the module docstring)."""
    params = list(params)
    index = {id(p): i for i, p in enumerate(params)}
    excluded = {_storage(p) for p in params} | {_storage(p.grad) for p in params if p.grad is not None}
    storages: dict[int, int] = {}
    owned: set[int] = set()
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > MAX_DEPTH or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, nn.Module)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = _storage(obj)
            if key not in excluded:
                storages[key] = obj.untyped_storage().nbytes()
            return
        if isinstance(obj, torch.optim.Optimizer):
            for param, state in obj.state.items():
                if id(param) in index and any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in state.values()):
                    owned.add(index[id(param)])
        if isinstance(obj, dict):
            for key, value in obj.items():
                visit(key, depth + 1)
                visit(value, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                visit(value, depth + 1)
        elif hasattr(obj, "__dict__") and _walkable(obj):
            visit(vars(obj), depth + 1)

    visit(optimizer, 0)
    return Holdings(bytes=sum(storages.values()), owned=tuple(sorted(owned)),
                    owned_elements=sum(params[i].numel() for i in owned))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _walkable(obj: Any) -> bool:
    """Optimizers and plain Python objects the learner made; not modules, process groups or torch internals."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    module = type(obj).__module__ or ""
    return not module.startswith(("torch", "builtins", "numpy", "pandas"))
