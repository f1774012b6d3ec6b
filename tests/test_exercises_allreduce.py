"""The ring all-reduce exercise's checker (lesson 24 to come): the reference passes on 2, 3 and 4 ranks, and each
classic mistake fails naming its cause and the learner's function; a deadlock is reported at the learner's line."""
from __future__ import annotations

import torch

from labkit.exercises.checks_allreduce import check_ring_allreduce, ring_all_reduce


def test_the_reference_passes_on_2_3_and_4_ranks(runs_root, no_leftovers):
    report = check_ring_allreduce(ring_all_reduce, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is ring_all_reduce


def _ring(tensor, wire, *, divide=True, gather=True, scatter=True, gather_shift=0, whole=False):
    rank, world = wire.rank, wire.world
    chunks = list(tensor.chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    phases = [p for p, on in (("rs", scatter), ("ag", gather)) if on]
    for phase in phases:
        for step in range(world - 1):
            out = (rank - step) % world if phase == "rs" else (rank + 1 - step + gather_shift) % world
            into = (out - 1) % world
            payload = tensor.clone() if whole else chunks[out].contiguous()
            got = torch.empty_like(payload)
            sent = wire.isend(payload, right)
            wire.recv(got, left)
            sent.wait()
            got = got.chunk(world)[into] if whole else got   # the left rank sent its whole tensor
            if phase == "rs":
                chunks[into] += got
            else:
                chunks[into].copy_(got)
    if divide:
        tensor.div_(world)


def summed(tensor, wire):
    _ring(tensor, wire, divide=False)


def no_all_gather(tensor, wire):
    _ring(tensor, wire, gather=False)


def no_reduce_scatter(tensor, wire):
    _ring(tensor, wire, scatter=False)


def gather_off_by_one(tensor, wire):
    _ring(tensor, wire, gather_shift=1)


def whole_tensor_each_step(tensor, wire):
    _ring(tensor, wire, whole=True)


def test_each_classic_mistake_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, words in [(summed, "you summed"), (no_all_gather, "the all-gather phase is missing"),
                      (no_reduce_scatter, "the reduce-scatter phase is missing"),
                      (gather_off_by_one, "chunk"), (whole_tensor_each_step, "not the whole tensor")]:
        report = check_ring_allreduce(fn, worlds=(3,), runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def parity_ordered(tensor, wire):
    """A correct ring written another way: blocking calls, even ranks send first, odd ranks receive first."""
    rank, world = wire.rank, wire.world
    chunks = list(tensor.chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for phase in ("rs", "ag"):
        for step in range(world - 1):
            out = (rank - step) % world if phase == "rs" else (rank + 1 - step) % world
            into = (out - 1) % world
            got = torch.empty_like(chunks[into])
            if rank % 2 == 0:
                wire.send(chunks[out].contiguous(), right)
                wire.recv(got, left)
            else:
                wire.recv(got, left)
                wire.send(chunks[out].contiguous(), right)
            if phase == "rs":
                chunks[into] += got
            else:
                chunks[into].copy_(got)
    tensor.div_(world)


def test_a_ring_of_blocking_calls_ordered_by_parity_passes(runs_root, no_leftovers):
    report = check_ring_allreduce(parity_ordered, worlds=(2, 4), runs_root=runs_root)
    assert report.ok, report.text()


def sends_first(tensor, wire):
    """The classic deadlock: every rank calls a blocking send before its receive."""
    rank, world = wire.rank, wire.world
    chunks = list(tensor.chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        out = (rank - step) % world
        got = torch.empty_like(chunks[(out - 1) % world])
        wire.send(chunks[out].contiguous(), right)
        wire.recv(got, left)
        chunks[(out - 1) % world] += got


def test_blocking_sends_first_deadlock_on_a_large_tensor_and_the_hang_names_the_learners_send(runs_root,
                                                                                            no_leftovers):
    """32 MB on 2 ranks: each 16 MB chunk is larger than gloo's socket buffers, so each send waits for a receive."""
    report = check_ring_allreduce(sends_first, worlds=(2,), size=8 * 2**20, timeout=4, runs_root=runs_root)
    text = report.text()
    assert not report.ok and report.blamed == ["sends_first"], text
    assert "test_exercises_allreduce.py" in text and "in sends_first" in text, text
    assert "isend/irecv" in text and "context.py" not in text, text
