"""Count collectives where every one of them passes: torch's op dispatcher, below DTensor, FSDP2 and DDP alike.

    with DispatchCounter() as wire:        # in a rank, around one or more training steps
        loss = model(x).sum(); loss.backward()
    wire.take()                            # (calls, bytes) since the last take()
    wire.take_kinds()                      # {"all_gather": (5, 1024), "reduce_scatter": (3, 4096), ...}

Why a second counter (commhooks.count_collectives wraps torch.distributed's Python functions): FSDP2 calls
`dist.all_gather_single` / `dist.reduce_scatter_single`, and DTensor tensor parallelism calls functional
collectives (torch.ops._c10d_functional.*) that never pass through those Python functions at all. Every
collective, whichever path it takes, ends as one op on the dispatcher: c10d's in-place ops (`c10d.allreduce_`,
`c10d._allgather_base_`, ...) or the functional ones. A TorchDispatchMode sees each exactly once: while the mode
handles an op, it is switched off, so the op's own inner calls are not counted again. This is how torch's
CommDebugMode counts too; ours keeps only counts and bytes, cheaply enough to run on every step.

Bytes are those of the tensor this rank hands over (as in commhooks): all_reduce and broadcast the tensor,
all_gather this rank's shard (its input), reduce_scatter the full input. A collective over a group of one rank
reaches nobody and is not counted. Point-to-point messages (a pipeline's activations and gradients between
stages) are ops on the dispatcher too, c10d.send and c10d.recv_: counted as "send" (bytes sent) and "recv" (bytes
of the buffers received into).
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name on the dispatcher (c10d's in-place ops, then functional collectives) -> the kind we report
KINDS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast",
         "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
         "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "reduce_": "reduce",
         "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "broadcast": "broadcast",
         "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
         "all_to_all_single": "all_to_all",
         "send": "send", "recv_": "recv", "recv_any_source_": "recv"}  # point-to-point (pipeline stages)
NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
SENT = ("input_tensor", "input_tensors", "inputs", "input", "tensors", "tensor")  # what this rank hands over


class DispatchCounter(TorchDispatchMode):
    """Counts collective ops at the dispatcher, by kind, with the bytes handed to them (see the module docstring).

    Use as a context manager on the thread that runs forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._calls = 0
        self._bytes = 0
        self._kinds: Counter[str] = Counter()
        self._kind_bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, _dtensor_type()) for t in types):
            return NotImplemented  # let DTensor turn the op into plain ops and collectives, which we then see
        out = func(*args, **kwargs)
        kind = _kind(func)
        if kind is not None:
            bound = _bind(func, args, kwargs)
            if _group_size(bound) != 1:
                sent = _bytes(next((bound[name] for name in SENT if name in bound), ()))
                with self._lock:
                    self._calls += 1
                    self._bytes += sent
                    self._kinds[kind] += 1
                    self._kind_bytes[kind] += sent
        return out

    def take(self) -> tuple[int, int]:
        """(calls, bytes) since the last take(); the kinds are kept until take_kinds()."""
        with self._lock:
            out = (self._calls, self._bytes)
            self._calls = self._bytes = 0
        return out

    def take_kinds(self) -> dict[str, tuple[int, int]]:
        """(calls, bytes) per kind ("all_reduce", "all_gather", "reduce_scatter", "broadcast", ...) since the last
        call."""
        with self._lock:
            out = {kind: (n, self._kind_bytes[kind]) for kind, n in self._kinds.items()}
            self._kinds.clear()
            self._kind_bytes.clear()
        return out


def _kind(func: Any) -> str | None:
    namespace = getattr(func, "namespace", None)
    if namespace not in NAMESPACES:
        return None
    return KINDS.get(func._schema.name.split("::")[-1])


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _group_size(bound: dict[str, Any]) -> int | None:
    group = bound.get("process_group")
    if isinstance(group, torch.ScriptObject):  # how the dispatcher passes a ProcessGroup
        from torch.distributed import ProcessGroup
        group = ProcessGroup.unbox(group)
    if group is not None and callable(getattr(group, "size", None)):
        return group.size()
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"]
    name = bound.get("group_name")
    if name is not None:
        from torch.distributed.distributed_c10d import _resolve_process_group
        try:
            return _resolve_process_group(name).size()
        except (RuntimeError, ValueError, KeyError):
            return None
    return None


def _bytes(handed: Any) -> int:
    if isinstance(handed, torch.Tensor):
        return handed.element_size() * handed.numel()
    if isinstance(handed, (list, tuple)):
        return sum(_bytes(t) for t in handed)
    return 0


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor
    return DTensor
