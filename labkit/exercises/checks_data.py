"""Shard each epoch yourself (lesson 07): a rank's loader for one epoch, checked on 2 and 3 gloo
ranks by the samples each rank was handed.

    def epoch_loader(dataset, rank, world, epoch, batch_size):   # this rank's batches, this epoch
        ...                                           # DistributedSampler, set_epoch, a DataLoader
    report = check_epoch_loader(epoch_loader)
    epoch_loader = report.use(sharded_loader)         # yours if it passed

Each rank calls `epoch_loader` for epochs 0 and 1 on a dataset whose samples are their own indices
(25 of them: it divides by neither 2 nor 3) and iterates what it returns; the checker reads the ids
in every batch each rank got. The reference is not the learner's code path but set arithmetic on
those ids: in each epoch the ranks' reads are counted, and every sample must be read once, except
DistributedSampler's own padding (fewer than `world` repeats) or its drop_last (fewer than `world`
left out). What is checked, on each world size:

    runs       every rank finished (a raise names the rank and the learner's line; a hang, each
               rank's place)
    sharded    the ranks did not each read the whole dataset (no sampler: world x the data each
               epoch), nor overlapping shares (a seed or rank off the one shuffled list), nor left
               samples out (how many, named)
    even       every rank has as many batches each epoch: in a DDP loop a rank with one more batch
               waits in an all-reduce for a rank that has left (lesson 07's hang): pad, drop_last,
               or train under Join
    reshuffled epoch 1 is not epoch 0 again on every rank (set_epoch never called, or no shuffle)
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from .learner import learner_part, run_checked
from .report import Report

SAMPLES = 25          # divides by neither 2 nor 3: padding, drop_last and uneven splits all show
BATCH = 4
EPOCHS = 2
MOST_READS = 4        # a rank handed over 4x the dataset in one epoch is cut off (never ends?)
HANG_HINT = ("epoch_loader needs no communication: if yours agrees on a batch count with the other "
             "ranks, every rank must make the same calls in the same order (a blocking recv on "
             "every rank waits forever).")


def sharded_loader(dataset: Any, rank: int, world: int, epoch: int, batch_size: int) -> DataLoader:
    """The reference: this rank's share of one shuffled list (the same seed on every rank),
    reshuffled each epoch by set_epoch, padded by the sampler so every rank gets as many batches."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def batch_ids(batch: Any) -> list[int]:
    """The sample ids in one batch, whatever its form: a tensor, an int, a list or tuple of those
    (a TensorDataset's batch is a list of one tensor)."""
    if isinstance(batch, torch.Tensor):
        return [int(i) for i in batch.flatten().tolist()]
    if isinstance(batch, (list, tuple)):
        return [i for part in batch for i in batch_ids(part)]
    return [int(batch)]


def _drive(ctx: Any, fn: Callable, n: int, batch_size: int, epochs: int,
           name: str) -> list[list[list[int]]]:
    """Inside a rank: the ids of every batch the learner's loader handed it, a list per epoch."""
    dataset = list(range(n))        # sample i is its own id: what a rank read is what it was handed
    out = []
    for epoch in range(epochs):
        batches: list[list[int]] = []
        # iterating is the learner's code too (their sampler, their loader): its errors are theirs
        with learner_part(ctx, name, epoch):
            for batch in fn(dataset, ctx.rank, ctx.world_size, epoch, batch_size):
                batches.append(batch_ids(batch))
                if sum(map(len, batches)) > MOST_READS * n:   # judged on what it gave so far
                    break
        out.append(batches)
    return out


def check_epoch_loader(fn: Callable, *, worlds: tuple[int, ...] = (2, 3), samples: int = SAMPLES,
                       batch_size: int = BATCH, timeout: float = 20.0,
                       runs_root: Any = None) -> Report:
    """Run `fn(dataset, rank, world, epoch, batch_size)` on each world size for two epochs and
    report on the samples each rank read:  check_epoch_loader(epoch_loader).ok."""
    name = getattr(fn, "__name__", "your loader")
    report = Report(f"{name}: each rank's batches for {EPOCHS} epochs of {samples} samples on "
                    f"{' and '.join(map(str, worlds))} gloo ranks", implementation=fn)
    for world in worlds:
        drive = functools.partial(_drive, fn=fn, n=samples, batch_size=batch_size, epochs=EPOCHS,
                                  name=name)
        outcomes = run_checked(report, drive, world_size=world, timeout=timeout,
                               name=f"check-{name}-{world}", runs_root=runs_root,
                               hang_hint=HANG_HINT)
        if outcomes is None:
            return report
        report.measured[f"reads_{world}"] = outcomes
        ok = _sharded(report, outcomes, world, samples, batch_size, name)
        if ok is None:      # every rank read everything: the other checks would only repeat it
            return report
        ok = _even(report, outcomes, world, name) and ok
        ok = _reshuffled(report, outcomes, world, name) and ok
        if not ok:
            return report
    return report


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _sharded(report: Report, outcomes: list, world: int, n: int, batch_size: int,
             name: str) -> bool | None:
    """Set arithmetic on one epoch's reads at a time: True if each epoch reads every sample once
    (but for the sampler's padding or drop_last), False if not, None if every rank read all."""
    repeats_allowed = math.ceil(n / world) * world - n      # DistributedSampler's padding
    missing_allowed = n - n // world * world                # what its drop_last leaves out
    for epoch in range(EPOCHS):
        reads = [_flat(outcome[epoch]) for outcome in outcomes]
        said = f"{world} ranks, epoch {epoch}: "
        outside = sorted({i for ids in reads for i in ids if not 0 <= i < n})
        if outside:
            report.add("sharded", "fail", f"{said}ids {outside[:5]} are no sample of the dataset "
                                          f"(0..{n - 1}): hand back batches of its own samples",
                       part=name)
            return False
        if all(set(ids) == set(range(n)) for ids in reads):
            report.add("sharded", "fail", f"{said}every rank read all {n} samples: {world}x the "
                                          "data each epoch, the same samples on every rank; give "
                                          "the DataLoader a DistributedSampler(dataset, "
                                          "num_replicas=world, rank=rank)", part=name)
            return None
        counts = Counter(i for ids in reads for i in ids)
        repeats = sum(c - 1 for c in counts.values())
        missing = n - len(counts)
        if (repeats <= repeats_allowed and missing == 0) or \
                (repeats == 0 and missing <= missing_allowed):
            continue
        report.add("sharded", "fail", said + _what_is_wrong(
            reads, counts, repeats, missing, n, batch_size, repeats_allowed, missing_allowed),
            part=name)
        return False
    report.add("sharded", "pass", f"{world} ranks: in each epoch the ranks read disjoint shares "
                                  f"covering the {n} samples (the sampler's padding or drop_last "
                                  "aside)")
    return True


def _what_is_wrong(reads: list[list[int]], counts: Counter, repeats: int, missing: int, n: int,
                   batch_size: int, repeats_allowed: int, missing_allowed: int) -> str:
    """One epoch's wrong split in words: the shares overlap, or samples are left out; how many."""
    shared = sum(1 for c in counts.values() if c > 1)
    if len({tuple(sorted(set(ids))) for ids in reads}) == 1:
        return (f"every rank read the same {len(set(reads[0]))} samples: each rank must take its "
                "own share (rank=rank in the sampler, not a constant)")
    if shared and missing:
        return (f"the ranks' shares overlap: {shared} samples read by more than one rank, "
                f"{missing} never read. Every rank must take its slice of one shuffled list: the "
                "same seed on every rank, rank=rank, num_replicas=world")
    if shared:
        return (f"{repeats} reads repeat a sample ({shared} samples read more than once); the "
                f"sampler's padding repeats at most {repeats_allowed}")
    cut = all(len(ids) % batch_size == 0 for ids in reads)
    return (f"{missing} of {n} samples never read; the sampler's drop_last leaves out at most "
            f"{missing_allowed}" + (": a DataLoader with drop_last=True drops each rank's last "
                                    "partial batch as well" if cut else ""))


def _even(report: Report, outcomes: list, world: int, name: str) -> bool:
    for epoch in range(EPOCHS):
        counts = [len(outcome[epoch]) for outcome in outcomes]
        if len(set(counts)) > 1:
            most, least = counts.index(max(counts)), counts.index(min(counts))
            report.add("even", "fail", f"{world} ranks, epoch {epoch}: rank {most} gets "
                                       f"{counts[most]} batches, rank {least} {counts[least]}: "
                                       f"in a DDP loop rank {most}'s batch {counts[least] + 1} "
                                       "all-reduces with a rank that has left, and waits forever. "
                                       "Give every rank as many batches (the sampler's padding, or "
                                       "drop_last=True), or train under Join", part=name)
            return False
    report.add("even", "pass", f"{world} ranks: every rank gets as many batches each epoch "
                               f"({len(outcomes[0][0])} in epoch 0)")
    return True


def _descents(ids: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(ids) if b < a)


def _reshuffled(report: Report, outcomes: list, world: int, name: str) -> bool:
    orders = [[_flat(epoch) for epoch in outcome] for outcome in outcomes]
    replayed = [rank for rank, epochs in enumerate(orders) if epochs[1] == epochs[0]]
    if len(replayed) == world:
        # in index order but for one descent: the padding's wrap-around to the first ids
        if all(_descents(epochs[0]) <= 1 for epochs in orders):
            report.add("reshuffled", "fail", f"{world} ranks: every rank reads its samples in "
                                             "index order, the same each epoch: shuffle "
                                             "(DistributedSampler(..., shuffle=True), its default) "
                                             "and call sampler.set_epoch(epoch)", part=name)
        else:
            report.add("reshuffled", "fail", f"{world} ranks: epoch 1 hands every rank the same "
                                             "samples in the same order as epoch 0: call "
                                             "sampler.set_epoch(epoch) before iterating (the "
                                             "sampler shuffles with seed + epoch)", part=name)
        return False
    chance = f" (rank {replayed[0]} read epoch 0's order again by chance)" if replayed else ""
    report.add("reshuffled", "pass", f"{world} ranks: epoch 1 is a new shuffle{chance}")
    return True
