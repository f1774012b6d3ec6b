"""Two ranks swap tensors with send and recv: the first point-to-point exchange, and its classic deadlock.

    def my_swap(tensor, wire):            # return the other rank's tensor; keep yours as it is
        other = 1 - wire.rank
        ...                               # wire.send / wire.recv / wire.isend / wire.irecv, as in checks_allreduce
    report = check_swap(my_swap)          # 2 gloo ranks: 4 bytes, then 1 MB
    my_swap = report.use(swap)            # yours if it passed

The deadlock: both ranks call a blocking `send` first. MPI's folklore says a small message passes anyway (an MPI
library may copy it into a buffer and return, the eager protocol) and only a large one hangs. torch's gloo backend
gives no such luck: its `send` is `isend(...).wait()`, and the wait returns only once the peer has posted the
matching receive, so both ranks wait at any size (measured with torch 2.13: one float hangs as 32 MB does). The
checker runs one element and 1 MB, so a solution that works only for small messages is caught too.

    runs      both ranks finished (a hang names each rank's line in your code and the call it waits in)
    values    each rank got the other's tensor, bit for bit, and its own is unchanged
    waited    every isend/irecv request was waited for before returning
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .checks_allreduce import Wire, waited
from .learner import learner_part, run_checked
from .report import Report

SIZES = (1, 2**18)   # float32 elements: 4 bytes and 1 MB
HANG_HINT = ("Both ranks called a blocking send() first: each waits for a recv() that the other, itself sending, "
             "never reaches (gloo's send waits for the matching recv at any size). Use isend/irecv and wait for "
             "both, or order the calls by rank: rank 0 sends first, rank 1 receives first.")


def swap(tensor: torch.Tensor, wire: Any) -> torch.Tensor:
    """The reference: post the send without blocking, receive, then wait for the send to finish."""
    other = 1 - wire.rank
    got = torch.empty_like(tensor)
    sending = wire.isend(tensor, other)
    wire.recv(got, other)
    sending.wait()
    return got


def size_label(elements: int) -> str:
    """A float32 tensor's size in words:  size_label(1024) -> '4 KB', size_label(1) -> '4 bytes'."""
    nbytes = elements * 4
    return f"{nbytes // 2**20} MB" if nbytes >= 2**20 else f"{nbytes // 2**10} KB" if nbytes >= 2**10 else \
        f"{nbytes} bytes"


def rank_tensor(rank: int, elements: int) -> torch.Tensor:
    """Rank r's tensor: its own values (r + 1 plus a pattern), so that a swapped, kept or mixed tensor is told apart."""
    return (rank + 1.0) * 1000.0 + torch.arange(elements, dtype=torch.float32) % 7


def _drive(ctx: Any, fn: Callable, elements: int, name: str) -> dict[str, Any]:
    mine, wire = rank_tensor(ctx.rank, elements), Wire(ctx.rank, ctx.world_size)
    with learner_part(ctx, name):
        got = fn(mine, wire)
    said = "None" if got is None else f"a {type(got).__name__}"
    return {"got": got if isinstance(got, torch.Tensor) else said,
            "kept": torch.equal(mine, rank_tensor(ctx.rank, elements)), "unwaited": wire.unwaited(),
            "sent_bytes": wire.sent_bytes}


def check_swap(fn: Callable, *, sizes: tuple[int, ...] = SIZES, timeout: float = 6.0,
               runs_root: Any = None) -> Report:
    """Run `fn(tensor, wire)` on 2 gloo ranks at each size and report:  check_swap(my_swap).ok.
    report.measured[label] is "passed", "hung" or "failed" for each size (label: size_label)."""
    name = getattr(fn, "__name__", "your swap")
    labels = [size_label(n) for n in sizes]
    report = Report(f"{name}: two ranks swap a tensor with send/recv, at {' and '.join(labels)}", implementation=fn)
    for elements, label in zip(sizes, labels):
        outcomes = run_checked(report, functools.partial(_drive, fn=fn, elements=elements, name=name),
                               world_size=2, timeout=timeout, name=f"check-{name}-{label.replace(' ', '')}",
                               runs_root=runs_root, hang_hint=f"At {label}: {HANG_HINT}")
        if outcomes is None:
            report.measured[label] = "hung" if any("made no progress" in f for f in report.failures) else "failed"
            return report
        if not (_values(report, outcomes, elements, label, name) and waited(report, outcomes, label, name)):
            report.measured[label] = "failed"
            return report
        report.measured[label] = "passed"
        report.measured[f"{label} sent bytes"] = [out["sent_bytes"] for out in outcomes]
    return report


def _values(report: Report, outcomes: list[dict], elements: int, label: str, name: str) -> bool:
    for rank, out in enumerate(outcomes):
        got, other = out["got"], rank_tensor(1 - rank, elements)
        if not isinstance(got, torch.Tensor):
            report.add("values", "fail", f"{label}: rank {rank}'s swap returned {got}, not a tensor: return the "
                                         "tensor you received into", part=name)
            return False
        if not out["kept"]:
            report.add("values", "fail", f"{label}: rank {rank}'s own tensor was changed: receive into a new "
                                         "tensor (torch.empty_like), not into the one you send", part=name)
            return False
        if torch.equal(got, rank_tensor(rank, elements)):
            report.add("values", "fail", f"{label}: rank {rank} got its own tensor back, not rank {1 - rank}'s: "
                                         "return what recv filled, received from the other rank", part=name)
            return False
        if got.shape != other.shape or not torch.equal(got, other):
            report.add("values", "fail", f"{label}: rank {rank}'s result is not rank {1 - rank}'s tensor "
                                         f"(shape {tuple(got.shape)}; the first values {got.flatten()[:3].tolist()}"
                                         f", want {other[:3].tolist()})", part=name)
            return False
    report.add("values", "pass", f"{label}: each rank got the other's tensor, bit for bit, and kept its own")
    return True
