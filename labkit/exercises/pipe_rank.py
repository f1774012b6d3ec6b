"""Inside each rank: run a learner's two-stage pipeline step, watched, and keep what it did.

    outcome = drive_pipeline(ctx, my_1f1b, microbatches=4)

The learner writes `step(stage, wire)`: one training step of a two-stage pipeline, rank 0 holding stage 0 and rank
1 stage 1, with the microbatches in the order it chooses. What it gets:
    stage.rank, stage.m        which stage this rank runs, how many microbatches
    stage.forward(i)           stage 0: the output activation of microbatch i (autograd keeps its graph)
    stage.forward(i, x)        stage 1: microbatch i's mean loss, from the activation x received for it
    stage.module               the stage's layers (their .grad is what the checker compares)
    wire.send(tensor)          to the other rank (asynchronous: it returns at once, as torch's isend does)
    wire.recv()                from the other rank: an activation (on stage 1) or its gradient (on stage 0)
The driver counts the activations stage 0 holds (a forward's output whose gradient has not arrived yet) and logs
each send and receive; a receive that blocks writes which one it is to <run dir>/wire<rank>.now, so that a
deadlock is reported by what each stage was waiting for.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..rundir import RunDir
from ..training.parallel.pipestep import NowFile
from .learner import learner_part

IN, WIDTH, CLASSES, ROWS, SEED = 8, 32, 4, 4, 1234


def build_stages(seed: int = SEED) -> tuple[nn.Module, nn.Module]:
    """The two halves of the checkers' model: stage 0 two tanh layers, stage 1 a tanh layer and the classifier."""
    torch.manual_seed(seed)
    first = nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
    second = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES))
    return first, second


def pipe_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + m)
    return torch.randn(m * ROWS, IN, generator=g), torch.randint(CLASSES, (m * ROWS,), generator=g)


class Stage:
    """One rank's half of the pipeline, as the learner sees it (see the module docstring)."""

    def __init__(self, rank: int, m: int):
        self.rank, self.m = rank, m
        self.module = build_stages()[rank]
        inputs, targets = pipe_batch(m)
        self._inputs, self._targets = inputs.chunk(m), targets.chunk(m)
        self.held = self.most_held = 0
        self.forwards: list[int] = []

    def forward(self, i: int, x: torch.Tensor | None = None) -> torch.Tensor:
        self.forwards.append(i)
        if self.rank == 0:
            out = self.module(self._inputs[i])
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            out.register_hook(self._released)  # its gradient arrives: backward frees this microbatch's graph
            return out
        if x is None:
            raise TypeError("stage 1's forward needs the activation received for this microbatch: "
                            "stage.forward(i, x) with x = wire.recv()")
        return F.cross_entropy(self.module(x), self._targets[i])

    def _released(self, grad: torch.Tensor) -> None:
        self.held -= 1


class Wire:
    """send/recv between the two ranks, logged; a blocking receive says so in a file while it waits."""

    def __init__(self, ctx: Any, rank: int):
        self.peer, self.log, self._sends = 1 - rank, [], []
        self._now = NowFile(RunDir(ctx.run_dir).wire_now(rank), f"stage {rank}: before its first send or receive")
        self.rank = rank
        self._received = 0

    def send(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"wire.send({tensor!r}): send a tensor. On stage 1 the gradient to send back is "
                            "x.grad, which exists only if the received x had requires_grad_() before forward")
        self.log.append(("send", tuple(tensor.shape)))
        self._sends.append(dist.isend(tensor.detach().contiguous(), self.peer))

    def recv(self) -> torch.Tensor:
        what = "an activation" if self.rank == 1 else "a gradient"
        self._received += 1
        self._now.write(f"stage {self.rank}: waiting in recv #{self._received} for {what}")
        buffer = torch.empty(ROWS, WIDTH)
        dist.recv(buffer, self.peer)
        self._now.write(f"stage {self.rank}: after recv #{self._received}")
        self.log.append(("recv", tuple(buffer.shape)))
        return buffer

    def finish(self) -> None:
        for work in self._sends:
            work.wait()


def reference_grads(m: int) -> dict[str, Any]:
    """One process, the unsplit model: the whole batch's gradients, and each microbatch's own (for diagnoses)."""
    first, second = build_stages()
    inputs, targets = pipe_batch(m)
    model = nn.Sequential(first, second)

    def grads(x: torch.Tensor, y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        return [{n: p.grad.clone() for n, p in part.named_parameters()} for part in (first, second)]

    return {"whole": grads(inputs, targets),
            "micro": [grads(x, y) for x, y in zip(inputs.chunk(m), targets.chunk(m))]}


def drive_pipeline(ctx: Any, step: Callable[[Stage, Wire], Any], microbatches: int) -> dict[str, Any]:
    """Run the learner's `step` once on this rank's stage; what it left in the gradients, and how it got there."""
    stage, wire = Stage(ctx.rank, microbatches), Wire(ctx, ctx.rank)
    ctx.heartbeat(0)
    with learner_part(ctx, "pipeline step", 0):
        step(stage, wire)
        wire.finish()
    dist.barrier()
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in stage.module.named_parameters()}
    return {"rank": ctx.rank, "grads": grads, "most_held": stage.most_held, "forwards": stage.forwards,
            "log": wire.log, "reference": reference_grads(microbatches)}
