"""Inside a rank, for checks_loop.py: the model, the data and the one-process reference of lessons
00 and 04, labkit's two reference solutions, and the Watch that sees what the learner's loop does
without changing it.

    watch = Watch(model, optimizer)    # forward pre-hook, optimizer step post-hook
    with watch.every_ddp():            # each DDP built inside gets a comm hook counting all-reduces
        train(ctx, model, optimizer, global_batches(3, 16))
    watch.result()                     # rows per forward, all-reduces, weights after each step

A DDP comm hook runs in the rank, once per bucket DDP sends: it is the one place Python sees DDP's
all-reduces (the reducer calls the process group from C++, past torch.distributed's functions).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .learner import learner_part

LR, FEATURES, WORLD = 0.05, 8, 2
LOOP_STEPS, LOOP_BATCH = 3, 16           # lesson 00: 3 steps of 16 samples, 8 per rank
ACCUM_STEPS, MICRO, MICRO_SIZE = 2, 4, 3  # lesson 04: per rank and step, 4 micro-batches of 3


def make_model() -> nn.Module:
    """The model both checkers train: the same initial weights on each rank and in the reference."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def global_batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch (x, y), the same on every rank: drawn from the step's number."""
    batches = []
    for step in range(steps):
        x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(1000 + step))
        batches.append((x, torch.tanh(x).sum(dim=1, keepdim=True)))
    return batches


def one_process(batches: list, keep_grads: bool = False) -> list[list[torch.Tensor]]:
    """The reference: no DDP, each step on the whole global batch with the mean loss; the weights
    after each step. keep_grads=True never zeroes the gradients (the mistake, to tell it apart)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    after = []
    for x, y in batches:
        if not keep_grads:
            optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def ddp_train(ctx: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
              batches: list) -> nn.Module:
    """labkit's lesson-00 loop: wrap in DDP; per global batch, this rank's share, zero, mean loss,
    backward (DDP averages the gradients over the ranks), step."""
    ddp_model = DDP(model)
    for x, y in batches:
        mine, target = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        optimizer.zero_grad()
        F.mse_loss(ddp_model(mine), target).backward()
        optimizer.step()
    return ddp_model


def accumulate_with_no_sync(ddp_model: Any, micro_batches: list,
                            optimizer: torch.optim.Optimizer) -> None:
    """labkit's lesson-04 step: every micro-batch but the last under no_sync(), each loss divided by
    their number; the last backward all-reduces the sum; one optimizer step."""
    optimizer.zero_grad()
    for x, y in micro_batches[:-1]:
        with ddp_model.no_sync():
            ((ddp_model(x) - y).pow(2).mean() / len(micro_batches)).backward()
    x, y = micro_batches[-1]
    ((ddp_model(x) - y).pow(2).mean() / len(micro_batches)).backward()
    optimizer.step()


class Watch:
    """The rows each forward got, the all-reduces DDP made, the weights after each optimizer
    step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.call, self.forwards, self.ddps = model, -1, 0, 0
        self.rows: list[tuple[int, torch.Tensor]] = []   # (optimizer steps before it, x)
        self.reduced: list[tuple[int, int]] = []         # (call, forwards before the backward)
        self.after: list[list[torch.Tensor]] = []        # the weights after each optimizer step
        self.stepped: list[int] = []                     # the call each optimizer step ran in
        model.register_forward_pre_hook(self._forward)
        optimizer.register_step_post_hook(self._stepped)

    def _forward(self, module: nn.Module, args: tuple) -> None:
        self.forwards += 1
        if args and isinstance(args[0], torch.Tensor):
            self.rows.append((len(self.after), args[0].detach().clone()))

    def _stepped(self, *_: Any) -> None:
        self.after.append([p.detach().clone() for p in self.model.parameters()])
        self.stepped.append(self.call)

    def comm_hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects other annotations
        self.reduced.append((self.call, self.forwards))
        return default_hooks.allreduce_hook(None, bucket)   # what DDP does with no hook: the mean

    @contextlib.contextmanager
    def every_ddp(self) -> Iterator[None]:
        """Every DDP built inside, the learner's own too, gets the counting comm hook (in a forked
        rank, whose DDP class is its own to patch)."""
        original = DDP.__init__

        def init(ddp: DDP, *args: Any, **kwargs: Any) -> None:
            original(ddp, *args, **kwargs)
            self.ddps += 1
            ddp.register_comm_hook(None, self.comm_hook)
        DDP.__init__ = init  # type: ignore[method-assign]
        try:
            yield
        finally:
            DDP.__init__ = original  # type: ignore[method-assign]

    def result(self) -> dict[str, Any]:
        return {"rows": self.rows, "reduced": self.reduced, "after": self.after,
                "stepped": self.stepped, "ddps": self.ddps, "forwards": self.forwards}


def drive_loop(ctx: Any, fn: Callable, name: str) -> dict[str, Any]:
    """A rank of check_ddp_loop: the learner's fn(ctx, model, optimizer, batches), watched."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    watch = Watch(model, optimizer)
    with watch.every_ddp(), learner_part(ctx, name):
        fn(ctx, model, optimizer, global_batches(LOOP_STEPS, LOOP_BATCH))
    return watch.result()


def drive_accum(ctx: Any, fn: Callable, name: str) -> dict[str, Any]:
    """A rank of check_accumulation: the checker wraps the model; the learner's
    fn(ddp_model, micro_batches, optimizer) makes each optimizer step, on this rank's samples."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    watch = Watch(model, optimizer)
    with watch.every_ddp():
        ddp_model = DDP(model)
    for step, (x, y) in enumerate(global_batches(ACCUM_STEPS, WORLD * MICRO * MICRO_SIZE)):
        mine, target = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        watch.call = step
        with learner_part(ctx, name, step):
            fn(ddp_model, list(zip(mine.chunk(MICRO), target.chunk(MICRO))), optimizer)
    return watch.result()
