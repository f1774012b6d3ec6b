"""What model state a rank really holds: bytes of parameters, gradients and optimizer state, found by walking tensors.

    meter = StateMeter(model, optimizer)     # hooks the optimizer's step and the model's forward
    ... train a step ...
    meter.fields()    # {"param_bytes", "grad_bytes", "optim_bytes", "peak_param_bytes", "act_bytes"}: bytes

Counted per rank, in bytes of the storage behind each tensor, each storage once (a tied weight, or shards that are
views of one buffer, count once):
    param_bytes      the parameters at the optimizer step: for DTensors (FSDP2 shards, tensor-parallel slices) the
                     local piece, including FSDP2's padding of a shard to an equal size on every rank
    grad_bytes       the gradients at the optimizer step (after DDP's all-reduce or FSDP's reduce-scatter)
    optim_bytes      the optimizer's state tensors just after the step (for ZeroRedundancyOptimizer: its local
                     optimizer's); Adam's two moments plus one small `step` tensor per parameter tensor
    peak_param_bytes the most parameter bytes held at once during forward (looked at as each transformer block
                     starts and when forward ends): FSDP's gathered full parameters on top of the shards it keeps
    act_bytes        activations: what autograd saved during forward for backward (saved_tensors_hooks),
                     parameters excepted; what a larger batch, a longer sequence or a wider model makes grow

Measuring costs about 1 ms per step on the tiny GPT-2 (some 6% of its step here): labkit's loop measures the first
few steps only (strategies.COUNTED_STEPS), the numbers do not change after the first step. The step is measured
by hooks on the optimizer's step, so the gradients are still there (labkit's loop sets them
to None right after); forward by hooks on the model and its blocks. Nothing here issues a collective.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The piece of `tensor` this rank holds: a DTensor's local tensor, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors by their local pieces; non-tensors skipped)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = local(tensor).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The state tensors of `optimizer` (for a ZeroRedundancyOptimizer, of the local optimizer it wraps)."""
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor)]


class SavedTensors:
    """What autograd keeps for backward from the forwards run inside it: every tensor saved (saved_tensors_hooks)
    that is not a weight or a view of one, each storage once, counted only while still held.

        with SavedTensors() as saved:
            out = model(x)           # keep the output: it holds the graph, and the graph the saved tensors
        saved.bytes()                # bytes held now
        with SavedTensors(modules=model) as saved: ...
        saved.held()                 # [(label, bytes)] per storage, label the innermost module saving it
                                     # ("(model)" for the model's own code, None outside its forward)

    Why "still held": a forward also builds branches nothing depends on (a router's statistics, say); autograd
    frees their saved tensors at once, and the allocator hands their addresses to later tensors. Keying storages
    by address alone then drops live tensors, or not, as the allocator happens to reuse memory, which differs from
    machine to machine. A weak reference to each saved tensor tells the freed from the held."""

    def __init__(self, label: Callable[[], Any] | None = None, modules: nn.Module | None = None):
        self._label = label
        self._entries: list[tuple[Any, int, int, Any]] = []   # (weak ref, storage address, its bytes, label)
        self._hooks: Any = None
        self._inside: list[str] = []
        self._handles: list[Any] = []
        if modules is not None:
            self._label = lambda: self._inside[-1] if self._inside else None
            for name, module in modules.named_modules():
                self._handles += [module.register_forward_pre_hook(self._enter(name or "(model)")),
                                  module.register_forward_hook(self._leave)]

    def _enter(self, name: str) -> Callable[..., None]:
        def enter(*_: Any) -> None:
            self._inside.append(name)
        return enter

    def _leave(self, *_: Any) -> None:
        self._inside.pop()   # returns None: a forward hook returning a value would replace the module's output

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(tensor):
            storage = local(tensor).untyped_storage()
            label = self._label() if self._label is not None else None
            self._entries.append((weakref.ref(tensor), storage.data_ptr(), storage.nbytes(), label))
        return tensor

    def held(self) -> list[tuple[Any, int]]:
        """(label, bytes) of each storage a saved tensor still holds, labelled by the first tensor saved in it."""
        seen: dict[int, tuple[Any, int]] = {}
        for ref, address, size, label in self._entries:
            if ref() is not None and address not in seen:
                seen[address] = (label, size)
        return list(seen.values())

    def bytes(self) -> int:
        """Bytes of the storages the saved tensors still hold."""
        return sum(size for _, size in self.held())


class StateMeter:
    """Measures the memory a rank holds on each step (see the module docstring), on the first `steps` optimizer
    steps only when `steps` is given; `fields()` reads a step's numbers."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int | None = None,
                 blocks: Iterable[nn.Module] | None = None):
        self.model, self.optimizer = model, optimizer
        self.steps_left = steps  # None: every step; else measure this many optimizer steps, then unhook
        self._fresh = False
        self._at_rest = [local(p) for p in model.parameters()]  # what stays held between steps
        self._values: dict[str, int] = {}
        self._saving: SavedTensors | None = None
        if blocks is None:  # GPT-2's blocks; other models name theirs (DeepSeek-V3: model.model.layers)
            blocks = getattr(getattr(model, "transformer", None), "h", [])
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step),
                         model.register_forward_pre_hook(self._forward_starts),
                         model.register_forward_hook(self._forward_ends)]
        # a block's own forward pre-hook runs after FSDP's, which has just gathered the block's parameters
        self._handles += [block.register_forward_pre_hook(self._block_starts) for block in blocks]

    def fields(self) -> dict[str, int]:
        """This step's measurements, as record fields ({} once the meter has stopped measuring)."""
        out = dict(self._values) if self._fresh else {}
        self._fresh = False
        if self.steps_left is not None and self.steps_left <= 0:
            self.remove()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _params_held(self) -> int:
        return storage_bytes([local(p) for p in self.model.parameters()] + self._at_rest)

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation: it keeps nothing for backward, and must not overwrite the step's numbers
        self._peak = self._params_held()
        self._saving = SavedTensors().__enter__()

    def _block_starts(self, module: nn.Module, args: Any) -> None:
        if self._saving is not None:
            self._peak = max(self._peak, self._params_held())

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._saving is None:
            return
        saving, self._saving = self._saving, None
        saving.__exit__(None, None, None)
        self._values["peak_param_bytes"] = max(self._peak, self._params_held())
        self._values["act_bytes"] = saving.bytes()   # `output` is alive here: so is the graph it holds

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        params = list(self.model.parameters())
        self._at_rest = [local(p) for p in params]
        self._values["param_bytes"] = storage_bytes(self._at_rest)
        self._values["grad_bytes"] = storage_bytes(p.grad for p in params if p.grad is not None)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._values["optim_bytes"] = storage_bytes(optimizer_tensors(self.optimizer))
        self._fresh = True
        if self.steps_left is not None:
            self.steps_left -= 1  # the hooks go in fields(): a hook cannot unhook itself while the hooks are running


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A weight saved for backward (itself or a view of it) is model state, not an activation."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
