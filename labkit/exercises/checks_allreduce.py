"""Build an all-reduce yourself from point-to-point messages: a ring, reduce-scatter then all-gather, checked on
2, 3 and 4 gloo ranks against what dist.all_reduce gives.

    def my_all_reduce(tensor, wire):       # leave in `tensor` the mean over the ranks, in place
        rank, world = wire.rank, wire.world
        ...                                # wire.send(t, to) / wire.recv(t, frm) / wire.isend / wire.irecv
    report = check_ring_allreduce(my_all_reduce)
    report.measured["sent/tensor 4 ranks"]                 # each rank's bytes sent / the tensor's bytes: 1.5 each
    my_all_reduce = report.use(ring_all_reduce)            # yours if it passed

`wire` is the learner's only way to talk to the other ranks: its calls are torch.distributed's send, recv, isend
and irecv (the same arguments, the peer by rank), and it counts the bytes each rank hands to them, so the traffic is
measured at the calls, not taken from the formula. The checker gives each rank an input whose every element tells
which ranks' values a sum holds (rank r adds 2**r times a pattern), so a wrong result is read back as the ranks it
holds, chunk by chunk:

    runs         every rank finished (a raise names the rank and the learner's line; a hang, each rank's place:
                 every rank sending first with blocking send() waits for a receiver that never comes once the
                 message is larger than gloo's socket buffers)
    values       every element is what dist.all_reduce makes of the same inputs, the mean (the sum is named as the sum; a chunk that holds some
                 ranks only is named with the ranks it holds and the phase that left it so)
    traffic      each rank sent 2(n-1)/n x the tensor's bytes: more is named (the whole tensor each step, or both
                 phases sending everything), less cannot be right
    waited       every isend/irecv request was waited for before the function returned (a result read before its
                 irecv completed may be right by luck)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from .learner import learner_part, run_checked
from .report import Report

TOLERANCE = 1e-6


def ring_all_reduce(tensor: torch.Tensor, wire: Any) -> None:
    """The reference: n-1 steps of reduce-scatter, then n-1 of all-gather, around the ring; the mean in place."""
    rank, world = wire.rank, wire.world
    chunks = list(tensor.chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            out = (rank - step) % world if phase == "reduce-scatter" else (rank + 1 - step) % world
            into = (out - 1) % world
            got = torch.empty_like(chunks[into])
            sent = wire.isend(chunks[out].contiguous(), right)
            wire.recv(got, left)
            sent.wait()
            if phase == "reduce-scatter":
                chunks[into] += got
            else:
                chunks[into].copy_(got)
    tensor.div_(world)


class Request:
    """An isend/irecv request handed to the learner: torch's Work, noting whether the learner waited for it."""

    def __init__(self, work: Any, kind: str):
        self.work, self.kind, self.waited = work, kind, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Wire:
    """torch.distributed's point-to-point calls for the learner, counting the bytes each hands over and the
    isend/irecv requests that were never waited for."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.sent_bytes, self.calls, self.requests = 0, [], []

    def _note(self, kind: str, tensor: torch.Tensor, peer: int) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.world or peer == self.rank:
            raise ValueError(f"{kind} to/from rank {peer!r}: the peer must be another rank, 0..{self.world - 1}")
        if kind in ("send", "isend"):
            self.sent_bytes += tensor.numel() * tensor.element_size()
        self.calls.append((kind, peer, tensor.numel()))

    def send(self, tensor: torch.Tensor, to: int) -> None:
        self._note("send", tensor, to)
        dist.send(tensor, dst=to)

    def recv(self, tensor: torch.Tensor, frm: int) -> None:
        self._note("recv", tensor, frm)
        dist.recv(tensor, src=frm)

    def isend(self, tensor: torch.Tensor, to: int) -> Request:
        self._note("isend", tensor, to)
        self.requests.append(Request(dist.isend(tensor, dst=to), "isend"))
        return self.requests[-1]

    def irecv(self, tensor: torch.Tensor, frm: int) -> Request:
        self._note("irecv", tensor, frm)
        self.requests.append(Request(dist.irecv(tensor, src=frm), "irecv"))
        return self.requests[-1]

    def unwaited(self) -> list[str]:
        """The kinds of the requests the learner never waited for, each then waited here (a rank must not leave
        with a message in flight)."""
        left = [request for request in self.requests if not request.waited]
        for request in left:
            request.work.wait()
        return [request.kind for request in left]


def rank_input(rank: int, size: int) -> torch.Tensor:
    """Rank r's tensor: 2**r times a pattern of small integers, so that any sum of ranks is exact in float32 and
    names the ranks it holds (a bit each)."""
    return (2.0 ** rank) * (1.0 + torch.arange(size, dtype=torch.float32) % 5)


def _drive(ctx: Any, fn: Callable, size: int, name: str) -> dict[str, Any]:
    tensor, wire = rank_input(ctx.rank, size), Wire(ctx.rank, ctx.world_size)
    with learner_part(ctx, name):
        fn(tensor, wire)
    unwaited = wire.unwaited()
    torchs = rank_input(ctx.rank, size)   # what torch's own all-reduce makes of the same input: the reference
    dist.all_reduce(torchs)
    dist.barrier()
    return {"result": tensor, "sent_bytes": wire.sent_bytes, "calls": wire.calls, "unwaited": unwaited,
            "torchs": torchs / ctx.world_size}


def held_ranks(values: torch.Tensor, world: int, size: int, start: int) -> list[float]:
    """Per element of a chunk starting at `start`: the sum of 2**r over the ranks it holds (the mean undone)."""
    pattern = 1.0 + (torch.arange(start, start + len(values), dtype=torch.float32) % 5)
    return (values * world / pattern).tolist()


def check_ring_allreduce(fn: Callable, *, worlds: tuple[int, ...] = (2, 3, 4), size: int = 1200,
                         timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Run `fn(tensor, wire)` on each world size and report on it:  check_ring_allreduce(my_all_reduce).ok."""
    name = getattr(fn, "__name__", "your all-reduce")
    report = Report(f"{name}: a ring all-reduce from send/recv on {', '.join(map(str, worlds))} gloo ranks",
                    implementation=fn)
    for world in worlds:
        outcomes = run_checked(report, functools.partial(_drive, fn=fn, size=size, name=name), world_size=world,
                               timeout=timeout, name=f"check-{name}-{world}", runs_root=runs_root,
                               hang_hint="In a ring every rank sends and receives at each step: if every rank "
                                         "calls a blocking send() first, each waits for a receiver that is itself "
                                         "sending. Post the receive first on odd ranks, or use isend/irecv.")
        if outcomes is None:
            return report
        # the bytes each rank handed to send/isend, as a multiple of the tensor's (for the lesson's own claims)
        report.measured[f"sent/tensor {world} ranks"] = [out["sent_bytes"] / (size * 4) for out in outcomes]
        if not (_values(report, outcomes, world, size, name) and _traffic(report, outcomes, world, size, name)
                and waited(report, outcomes, f"{world} ranks", name)):
            return report
    return report


def _values(report: Report, outcomes: list[dict], world: int, size: int, name: str) -> bool:
    want = outcomes[0]["torchs"]   # dist.all_reduce's mean, on the same inputs
    everyone = float(2 ** world - 1)
    for rank, out in enumerate(outcomes):
        got = out["result"]
        if got.shape != want.shape:
            report.add("values", "fail", f"{world} ranks: rank {rank}'s tensor has shape {tuple(got.shape)}, not "
                                         f"{tuple(want.shape)}: work in place on the tensor you were given",
                       part=name)
            return False
        if torch.allclose(got, want, atol=TOLERANCE):
            continue
        if torch.allclose(got, want * world, atol=TOLERANCE):
            report.add("values", "fail", f"{world} ranks: every element is {world}x the mean: you summed; the mean "
                                         f"divides the sum by the world size ({world})", part=name)
            return False
        report.add("values", "fail", f"{world} ranks: " + _which_ranks(got, rank, world, size, everyone),
                   part=name)
        return False
    report.add("values", "pass", f"{world} ranks: every rank holds the mean of the {world} ranks' tensors")
    return True


def _which_ranks(got: torch.Tensor, rank: int, world: int, size: int, everyone: float) -> str:
    """What a wrong result holds, chunk by chunk, in words: which ranks each chunk sums."""
    said, start = [], 0
    for index, chunk in enumerate(got.chunk(world)):
        held = held_ranks(chunk, world, size, start)
        start += len(chunk)
        first = held[0]
        if all(abs(h - first) < 1e-3 for h in held) and abs(first - round(first)) < 1e-3 and first > 0:
            ranks = [r for r in range(world) if int(round(first)) >> r & 1]
            if int(round(first)) != everyone and int(round(first)) < 2 ** world:
                said.append((index, ranks))
        else:
            said.append((index, None))
    if not said:
        return f"rank {rank}'s result is off in a way that is no sum of ranks: check the division by the world size"
    index, ranks = said[0]
    if ranks is None:
        return (f"rank {rank}'s chunk {index} is no sum of whole ranks' chunks (mixed positions): a chunk was added "
                "into, or copied to, another chunk's place; check the chunk index at each step")
    if all(r is not None and len(r) == 1 for _, r in said) and len(said) >= world - 1:
        return (f"rank {rank}'s chunk {index} holds rank {ranks[0]}'s values only, not the sum of all {world}: the "
                "reduce-scatter phase is missing (chunks were copied round the ring, never added)")
    full = sum(1 for i, r in said if r is None) == 0 and len(said) == world - 1
    phase = ("the all-gather phase is missing (only the reduce-scatter ran: one chunk per rank is complete)"
             if full else "a step of the reduce-scatter sent or added the wrong chunk, or the all-gather copied one "
                          "that was not complete yet")
    return f"rank {rank}'s chunk {index} holds the sum of ranks {ranks} only, not all {world}: {phase}"


def _traffic(report: Report, outcomes: list[dict], world: int, size: int, name: str) -> bool:
    want = 2 * (world - 1) * (size // world) * 4   # float32, chunks of size / world
    rank = max(range(len(outcomes)), key=lambda r: outcomes[r]["sent_bytes"])
    sent = outcomes[rank]["sent_bytes"]
    if sent > want * 1.01 + 8 * world:
        report.add("traffic", "fail", f"{world} ranks: rank {rank} sent {sent:,} bytes, {sent / want:.2f}x a ring's "
                                      f"2(n-1)/n x {size * 4:,} = {want:,}: send one chunk (1/n of the tensor) per "
                                      "step, not the whole tensor", part=name)
        return False
    report.add("traffic", "pass", f"{world} ranks: each rank sent 2(n-1)/n of the tensor's bytes ({want:,})")
    return True


def waited(report: Report, outcomes: list[dict], label: str, name: str) -> bool:
    """Fail when a rank returned with isend/irecv requests it never waited for (Wire.unwaited)."""
    for rank, out in enumerate(outcomes):
        if out["unwaited"]:
            kinds = ", ".join(sorted(set(out["unwaited"])))
            report.add("waited", "fail", f"{label}: rank {rank} returned with {len(out['unwaited'])} {kinds} "
                                         f"request(s) never waited for: until .wait() returns, an irecv's tensor may "
                                         "not hold the message yet and an isend's may not be reused", part=name)
            return False
    report.add("waited", "pass", f"{label}: every isend/irecv request was waited for")
    return True
