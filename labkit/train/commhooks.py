"""How DDP sends gradients, and how much: comm hooks that also count all-reduces and bytes on the wire.

    counter = install_comm_hook(ddp, "fp16")        # or "allreduce", "bf16", "powersgd"
    ... one training step ...
    calls, wire_bytes = counter.take()              # since the last take(): what the ranks' gradients cost

labkit.train installs one on every run (RunConfig.comm_hook) and records `allreduces` and `comm_bytes` per step.
Bytes are what one rank hands to the collective for its gradients (the payload, not the ring's traffic):
4 per fp32 element, 2 for fp16/bf16, and for PowerSGD the low-rank factors P and Q of each compressed matrix
plus the uncompressed tensors.

Backends differ: torch's bf16 hook refuses to register without CUDA+NCCL, so "bf16" here is our own
(cast, all-reduce, cast back), which gloo runs. PowerSGD on gloo aborts the process (a size mismatch inside gloo)
unless DDP has a single bucket: train() then uses one bucket, and says so in the rank's log.
"""
# No `from __future__ import annotations`: DDP inspects a hook's annotations and wants the real GradBucket type.
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

POWERSGD_START_ITER = 2  # the first steps all-reduce uncompressed (PowerSGD's warm-up); 2 is the least it allows
POWERSGD_MIN_COMPRESSION = 2.0  # compress a matrix only when that at least halves it (PowerSGD's default rule)


@dataclass
class CommCounter:
    """All-reduce calls and payload bytes since the last take()."""

    calls: int = 0
    bytes: int = 0

    def add(self, wire_bytes: int) -> None:
        self.calls += 1
        self.bytes += wire_bytes

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.bytes)
        self.calls = self.bytes = 0
        return out


def bf16_compress_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like torch's bf16 hook, but it runs on any backend that all-reduces bfloat16 (gloo does)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer
    return future.then(decompress)


def install_comm_hook(ddp: Any, name: str, *, powersgd_rank: int = 1) -> CommCounter:
    """Register the named hook on a DistributedDataParallel model, wrapped to count; returns the counter."""
    counter = CommCounter()
    if name == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                       start_powerSGD_iter=POWERSGD_START_ITER,
                                       min_compression_rate=POWERSGD_MIN_COMPRESSION)
        inner: Callable[..., Any] = powersgd.powerSGD_hook

        def payload(bucket: dist.GradBucket) -> int:
            return powersgd_bytes(bucket.gradients(), powersgd_rank, compressing=state.iter >= state.start_powerSGD_iter)
    else:
        state = None
        inner, element_bytes = {"allreduce": (default_hooks.allreduce_hook, None),
                                "fp16": (default_hooks.fp16_compress_hook, 2),
                                "bf16": (bf16_compress_hook, 2)}[name]

        def payload(bucket: dist.GradBucket) -> int:
            buffer = bucket.buffer()
            return buffer.numel() * (element_bytes or buffer.element_size())

    def counting_hook(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        counter.add(payload(bucket))
        return inner(hook_state, bucket)

    ddp.register_comm_hook(state, counting_hook)
    return counter


def powersgd_bytes(gradients: list[torch.Tensor], rank: int, compressing: bool = True) -> int:
    """Payload of one PowerSGD all-reduce round for these gradients: P (n x r) and Q (m x r) per compressed
    matrix, the rest sent whole; all in the gradients' dtype."""
    total = 0
    for grad in gradients:
        size = grad.element_size()
        if not compressing or grad.ndim <= 1:
            total += grad.numel() * size
            continue
        rows, cols = grad.shape[0], grad.numel() // grad.shape[0]
        low_rank = (rows + cols) * min(rank, rows, cols)
        compress = low_rank * POWERSGD_MIN_COMPRESSION < rows * cols
        total += (low_rank if compress else rows * cols) * size
    return total


def single_bucket_mb(model: torch.nn.Module) -> float:
    """A bucket_cap_mb that puts every gradient of `model` in one bucket (what PowerSGD needs on gloo)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1.0
