"""Reference solutions: data parallelism three ways, and a sharded optimizer (ZeRO stage 1), by hand.

    ddp = NaiveDDP(model)                        # or OverlapDDP(model), BucketedDDP(model, bucket_size_mb=1.0)
    loss_fn(ddp(x), y).backward()
    ddp.finish_gradient_synchronization()        # every rank now holds the average gradient
    optimizer.step()

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # each rank keeps 1/N of the state

The interface is the one well-known course assignments use, so the same classes run against their test suites:
a wrapper whose constructor broadcasts rank 0's parameters and which exposes finish_gradient_synchronization(),
a bucketed variant taking bucket_size_mb, and a sharded optimizer built as (params, optimizer_cls, **kwargs).
Gradients are summed by the all-reduce and divided by the world size here (ReduceOp.AVG is not on every backend).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank's parameters and buffers rank 0's (frozen ones too: they are part of the model)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=0)


class NaiveDDP(nn.Module):
    """After backward, all-reduce each gradient in turn: correct, and every byte waits for backward to end."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        broadcast_from_rank0(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        for param in self.module.parameters():  # yields a tied parameter once
            if param.requires_grad and param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size)


class OverlapDDP(nn.Module):
    """Each gradient's all-reduce starts, asynchronously, the moment backward has finished accumulating it, so it
    travels while backward computes the layers before it; finish_gradient_synchronization() waits for them all."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        broadcast_from_rank0(module)
        self._pending: list[Any] = []
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._launch)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _launch(self, param: torch.Tensor) -> None:
        param.grad.div_(self.world_size)  # divide first: the sum that comes back is then the mean
        self._pending.append(dist.all_reduce(param.grad, async_op=True))

    def finish_gradient_synchronization(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()


def plan_buckets(sizes: list[int], cap: float) -> list[list[int]]:
    """Group tensors, in the order given, into buckets of at most `cap` bytes; a tensor bigger than `cap` gets a
    bucket of its own:  plan_buckets([400, 400, 900, 100], cap=1000) == [[0, 1], [2, 3]]."""
    buckets: list[list[int]] = []
    filled = 0.0
    for index, size in enumerate(sizes):
        if buckets and filled + size <= cap:
            buckets[-1].append(index)
            filled += size
        else:
            buckets.append([index])
            filled = size
    return buckets


class _Bucket:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.ready = 0
        self.work: Any = None


class BucketedDDP(nn.Module):
    """Gradients packed into buckets of about bucket_size_mb, in the order backward produces them (the reverse
    of the parameters' order); a bucket's all-reduce starts when its last gradient is ready."""

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        broadcast_from_rank0(module)
        params = self._trained(module)[::-1]
        plan = plan_buckets([p.numel() * p.element_size() for p in params], bucket_size_mb * 2**20)
        self.buckets = [_Bucket([params[i] for i in indices]) for indices in plan]
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        for param in params:
            param.register_post_accumulate_grad_hook(self._ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @staticmethod
    def _trained(module: nn.Module) -> list[torch.Tensor]:
        """The parameters whose gradients travel, each once (parameters() yields a tied one once)."""
        return [p for p in module.parameters() if p.requires_grad]

    def _ready(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        offset = 0
        for param in bucket.params:
            piece = bucket.flat[offset:offset + param.numel()]
            if param.grad is None:  # a parameter unused this step contributes zeros
                piece.zero_()
            else:
                piece.copy_(param.grad.reshape(-1))
            offset += param.numel()
        bucket.flat.div_(self.world_size)
        bucket.work = dist.all_reduce(bucket.flat, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        for bucket in self.buckets:
            if bucket.work is None:  # some gradient never arrived: send what there is, every rank must join
                self._launch(bucket)
            bucket.work.wait()
            offset = 0
            for param in bucket.params:
                averaged = bucket.flat[offset:offset + param.numel()].view_as(param)
                if param.grad is None:
                    param.grad = averaged.clone()
                else:
                    param.grad.copy_(averaged)
                offset += param.numel()
            bucket.ready, bucket.work = 0, None


class ShardedOptimizer(torch.optim.Optimizer):
    """optimizer_cls over all parameters, with each rank keeping the state of its own share only (ZeRO stage 1).

    Trained parameters go, largest first, to the rank holding the fewest elements so far (frozen ones never get
    state, so they do not count); each rank steps its share, then every trained parameter is broadcast from the
    rank that owns it. Hyperparameters set on this optimizer's param_groups (by a scheduler, say) are passed on
    to the inner optimizer before each step."""

    def __init__(self, params: Iterable[Any], optimizer_cls: Callable[..., torch.optim.Optimizer],
                 **optimizer_kwargs: Any):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, optimizer_kwargs
        self.owner: dict[int, int] = {}          # id(param) -> the rank that owns it
        self._elements = [0] * self.world_size   # elements owned so far, per rank
        self.local: torch.optim.Optimizer | None = None
        self._local_group: dict[int, int] = {}   # index in param_groups -> index in local.param_groups
        super().__init__(params, defaults=dict(optimizer_kwargs))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for param in sorted((p for p in group["params"] if p.requires_grad), key=lambda p: -p.numel()):
            owner = min(range(self.world_size), key=lambda r: self._elements[r])
            self._elements[owner] += param.numel()
            self.owner[id(param)] = owner
            if owner == self.rank:
                mine.append(param)
        if not mine:
            return
        local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.local is None:
            self.local = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local.add_param_group(local_group)
        self._local_group[len(self.param_groups) - 1] = len(self.local.param_groups) - 1

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if self.local is not None:
            for outer, inner in self._local_group.items():
                self.local.param_groups[inner].update(
                    {k: v for k, v in self.param_groups[outer].items() if k != "params"})
            loss = self.local.step(closure, **kwargs)
        works = [dist.broadcast(param, src=self.owner[id(param)], async_op=True)
                 for group in self.param_groups for param in group["params"] if id(param) in self.owner]
        for work in works:
            work.wait()
        return loss
