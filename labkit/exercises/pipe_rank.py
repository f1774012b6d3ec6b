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
deadlock is reported by what each stage was waiting for. It also knows each microbatch's activation and gradient
(one process, the unsplit model), and writes down whose each tensor sent, each x given to stage 1's forward and
each gradient stage 0's backward got is, so that a mistake is named by the step and stage that makes it. Sends
that the other stage never received are received (and dropped) by the driver after the step, so that too many
sends are reported by their counts, not by a hang.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def microbatch_flow(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process, the unsplit model: each microbatch's activation between the stages, and the gradient of its
    loss / m with respect to that activation (what stage 1 sends back for it)."""
    first, second = build_stages()
    inputs, targets = pipe_batch(m)
    acts, grads = [], []
    for x, y in zip(inputs.chunk(m), targets.chunk(m)):
        act = first(x).detach().requires_grad_()
        (F.cross_entropy(second(act), y) / m).backward()
        acts.append(act.detach())
        grads.append(act.grad)
    return acts, grads


def whose(t: torch.Tensor, refs: list[torch.Tensor], m: int) -> tuple[int, int]:
    """(j, 1) if t is microbatch j's tensor of `refs`, (j, m) if it is m times that, (-1, 0) if neither."""
    for factor in (1, m):
        for j, ref in enumerate(refs):
            if t.shape == ref.shape and torch.allclose(t, ref * factor, rtol=1e-4, atol=1e-6 * factor):
                return j, factor
    return -1, 0


class Stage:
    """One rank's half of the pipeline, as the learner sees it (see the module docstring)."""

    def __init__(self, rank: int, m: int):
        self.rank, self.m = rank, m
        self.module = build_stages()[rank]
        inputs, targets = pipe_batch(m)
        self._inputs, self._targets = inputs.chunk(m), targets.chunk(m)
        self.held = self.most_held = 0
        self.forwards: list[int] = []
        self.acts, self.grads = microbatch_flow(m)
        self.acts_in: list[tuple[int, tuple[int, int]]] = []    # stage 1: (i, whose x was) per forward(i, x)
        self.grads_in: list[tuple[int, tuple[int, int]]] = []   # stage 0: (i, whose gradient came) per backward

    def forward(self, i: int, x: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(i, int) or not 0 <= i < self.m:
            raise IndexError(f"stage.forward({i!r}): the microbatches are 0 .. {self.m - 1}")
        self.forwards.append(i)
        if self.rank == 0:
            out = self.module(self._inputs[i])
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            out.register_hook(lambda grad: self._released(i, grad))  # its gradient arrives: its graph is freed
            return out
        if x is None:
            raise TypeError("stage 1's forward needs the activation received for this microbatch: "
                            "stage.forward(i, x) with x = wire.recv()")
        self.acts_in.append((i, whose(x.detach(), self.acts, self.m)))
        return F.cross_entropy(self.module(x), self._targets[i])

    def _released(self, i: int, grad: torch.Tensor) -> None:
        self.held -= 1
        self.grads_in.append((i, whose(grad, self.grads, self.m)))


class Wire:
    """send/recv between the two ranks, logged; a blocking receive says so in a file while it waits."""

    def __init__(self, ctx: Any, rank: int, stage: Stage | None = None):
        self.peer, self.log, self._sends = 1 - rank, [], []
        self.sent: list[tuple[int, int]] = []   # whose activation (stage 0) or gradient (stage 1) each send was
        self._stage = stage
        self._now = NowFile(RunDir(ctx.run_dir).wire_now(rank), f"stage {rank}: before its first send or receive")
        self.rank = rank
        self._received = 0

    def send(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"wire.send({tensor!r}): send a tensor. On stage 1 the gradient to send back is "
                            "x.grad, which exists only if the received x had requires_grad_() before forward")
        self.log.append(("send", tuple(tensor.shape)))
        if self._stage is not None:
            refs = self._stage.acts if self.rank == 0 else self._stage.grads
            self.sent.append(whose(tensor.detach(), refs, self._stage.m))
        self._sends.append(dist.isend(tensor.detach().contiguous(), self.peer))

    def recv(self) -> torch.Tensor:
        what = "an activation" if self.rank == 1 else "a gradient"
        self._received += 1
        self._now.write(f"stage {self.rank}: waiting in recv #{self._received} for {what} "
                        f"({len(self._sends)} sent)")
        buffer = torch.empty(ROWS, WIDTH)
        dist.recv(buffer, self.peer)
        self._now.write(f"stage {self.rank}: after recv #{self._received}")
        self.log.append(("recv", tuple(buffer.shape)))
        return buffer

    def finish(self) -> int:
        """After the step: receive (and drop) what the other stage sent that this one never received, then wait for
        this stage's own sends; how many were dropped. A receive the other stage waits for still hangs."""
        sends, recvs = len(self._sends), self._received
        self._now.write(f"stage {self.rank}: returned after {sends} sends and {recvs} receives")
        counts = [torch.zeros(2, dtype=torch.long) for _ in range(2)]
        dist.all_gather(counts, torch.tensor([sends, recvs]))
        extra = int(counts[self.peer][0]) - recvs
        for _ in range(max(extra, 0)):
            dist.recv(torch.empty(ROWS, WIDTH), self.peer)
        for work in self._sends:
            work.wait()
        self._now.write(f"stage {self.rank}: finished after {sends} sends and {recvs} receives")
        return max(extra, 0)


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


def drive_pipeline(ctx: Any, step: Callable[[Stage, Wire], Any], microbatches: int,
                   name: str = "pipeline step") -> dict[str, Any]:
    """Run the learner's `step` once on this rank's stage; what it left in the gradients, and how it got there."""
    stage = Stage(ctx.rank, microbatches)
    wire = Wire(ctx, ctx.rank, stage)
    ctx.heartbeat(0)
    with learner_part(ctx, name, 0):
        step(stage, wire)
    dropped = wire.finish()
    dist.barrier()
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in stage.module.named_parameters()}
    return {"rank": ctx.rank, "grads": grads, "most_held": stage.most_held, "forwards": stage.forwards,
            "log": wire.log, "reference": reference_grads(microbatches), "sent": wire.sent,
            "received": wire._received, "dropped": dropped, "acts_in": stage.acts_in, "grads_in": stage.grads_in}
