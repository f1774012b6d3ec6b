"""How DDP sends gradients, and what really went to the other ranks: comm hooks, and a counter of collectives.

    install_comm_hook(ddp, "fp16")              # or "allreduce", "bf16", "powersgd"
    with count_collectives() as wire:           # wraps torch.distributed's collectives in this process
        ... one training step ...
        calls, sent = wire.take()               # collectives issued since the last take(), and their bytes

labkit.train counts every run this way and records `allreduces` and `comm_bytes` per step.

What is counted is what was handed to torch.distributed, not what a formula says the hook sends: per collective
call, the itemsize of the tensor's dtype times its number of elements (for all_gather and reduce_scatter: this
rank's input). The fp16 hook's bucket counts 2 bytes per element because the tensor it all-reduces is float16;
PowerSGD counts as the collectives it issues (after its warm-up: one all-reduce of the uncompressed tensors, one of
the P factors, one of the Q factors, per bucket). A collective within a group of one rank reaches nobody and is
not counted (a 1-rank run; post-local SGD's per-rank subgroups).

What the counter cannot see: collectives that do not go through torch.distributed's Python functions. DDP
without a registered hook all-reduces from C++, so labkit always registers one: "allreduce" is torch's own
Python allreduce_hook, which sends exactly what DDP's built-in path sends.

Backends differ: torch's bf16 hook refuses to register without CUDA+NCCL, so "bf16" here is our own
(cast, all-reduce, cast back), which gloo runs. PowerSGD on gloo aborts the process (a size mismatch inside gloo)
unless DDP has a single bucket: train() then uses one bucket, and says so in the rank's log.
"""
# No `from __future__ import annotations`: DDP inspects a hook's annotations and wants the real GradBucket type.
import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

POWERSGD_START_ITER = 2  # the first steps all-reduce uncompressed (PowerSGD's warm-up); 2 is the least it allows
POWERSGD_MIN_COMPRESSION = 2.0  # compress a matrix only when that at least halves it (PowerSGD's default rule)

# The collectives that move data, each with the argument that holds what this rank hands over.
COUNTED = {"all_reduce": "tensor", "all_reduce_coalesced": "tensors", "broadcast": "tensor", "reduce": "tensor",
           "all_gather": "tensor", "all_gather_into_tensor": "input_tensor", "reduce_scatter": "input_list",
           "reduce_scatter_tensor": "input", "all_to_all_single": "input",
           # torch 2.13's names for the tensor forms (FSDP2 calls these); older torches lack them
           "all_gather_single": "input_tensor", "reduce_scatter_single": "input"}


class CollectiveCounter:
    """Collective calls this process issues through torch.distributed, and the bytes handed to them.

        with CollectiveCounter() as wire:     # or count_collectives()
            dist.all_reduce(torch.ones(10, dtype=torch.float16))
        wire.take()                           # (1, 20) on 2 ranks; (0, 0) on one

    While active, torch.distributed's collectives (and the same functions in distributed_c10d, which torch's own
    object collectives call) are wrapped; on exit they are restored. Thread-safe: comm hooks issue some
    all-reduces from future callbacks, which may run on a backend thread."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._paused = False
        self._inside = threading.local()  # this thread is inside a counted collective
        self._restore: list[tuple[Any, str, Callable[..., Any]]] = []

    def __enter__(self) -> "CollectiveCounter":
        for op, argument in COUNTED.items():
            original = getattr(dist, op, None)
            if original is None:
                continue
            wrapped = self._wrap(original, argument)
            for module in (dist, distributed_c10d):
                if getattr(module, op, None) is original:
                    self._restore.append((module, op, original))
                    setattr(module, op, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._restore:
            module, op, original = self._restore.pop()
            setattr(module, op, original)

    def take(self) -> tuple[int, int]:
        """(calls, bytes) since the last take(), and start again from zero."""
        with self._lock:
            out = (self.calls, self.bytes)
            self.calls = self.bytes = 0
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave out the collectives issued inside (a measurement that is not part of the method measured)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _wrap(self, original: Callable[..., Any], argument: str) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "call", False):  # a collective torch implements with another one
                return original(*args, **kwargs)  # (all_gather_into_tensor calls all_gather_single): count once
            bound = signature.bind(*args, **kwargs)
            if not self._paused and dist.get_world_size(bound.arguments.get("group")) > 1:
                sent = payload_bytes(bound.arguments[argument])
                with self._lock:
                    self.calls += 1
                    self.bytes += sent
            self._inside.call = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.call = False
        return counted


def count_collectives() -> CollectiveCounter:
    """A CollectiveCounter, to use as a context manager:  with count_collectives() as wire: ..."""
    return CollectiveCounter()


def payload_bytes(handed: Any) -> int:
    """Bytes of a tensor, or of a list of tensors: dtype itemsize x number of elements.  payload_bytes(t)."""
    if isinstance(handed, torch.Tensor):
        return handed.element_size() * handed.numel()
    return sum(payload_bytes(t) for t in handed)


def bf16_cast_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like torch's bf16_compress_hook, but it runs on any backend that all-reduces bfloat16 (gloo does).

    Not named bf16_compress_hook: DDP refuses a hook of that name unless CUDA+NCCL (or XPU+XCCL) is present."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer
    return future.then(decompress)


# RunConfig.comm_hook -> the hook DDP calls with each bucket.
HOOKS: dict[str, Callable[..., Any]] = {"allreduce": default_hooks.allreduce_hook,
                                        "fp16": default_hooks.fp16_compress_hook,
                                        "bf16": bf16_cast_hook,
                                        "powersgd": powersgd.powerSGD_hook}


def install_comm_hook(ddp: Any, name: str, *, powersgd_rank: int = 1) -> None:
    """Register the named hook on a DistributedDataParallel model:  install_comm_hook(ddp, "powersgd")."""
    if name not in HOOKS:
        raise ValueError(f"comm_hook = {name!r}: must be one of {', '.join(HOOKS)}")
    state = None
    if name == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                       start_powerSGD_iter=POWERSGD_START_ITER,
                                       min_compression_rate=POWERSGD_MIN_COMPRESSION)
    ddp.register_comm_hook(state, HOOKS[name])


def single_bucket_mb(model: torch.nn.Module) -> float:
    """A bucket_cap_mb that puts every gradient of `model` in one bucket (what PowerSGD needs on gloo)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1.0
