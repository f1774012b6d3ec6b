"""Every rank must see its own data: DistributedSampler's traps, uneven inputs, and skewed shards.

    from labkit.tricks import sharding
    sharding.sampler_ids(n=10, world=4, rank=1, epoch=0)                  # the sample ids rank 1 reads
    sharding.plot_shards(n=10, world=4)                                   # every rank's ids, padding marked
    run = labkit.launch(functools.partial(sharding.read_epochs, n=20, epochs=2, set_epoch=False), world_size=2)
    run = labkit.launch(functools.partial(sharding.uneven_epoch, batches=(6, 4), join=True), world_size=2)
    run = labkit.launch(functools.partial(sharding.train_shards, iid=False, period=16), world_size=2)

The launch targets run on real ranks and record what each rank read (or learned); the pure functions say what
DistributedSampler will do before anything runs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ..training.data import digits_data
from ..view import COLORS, new_figure, shown


def sampler_ids(n: int, world: int, rank: int, epoch: int, *, set_epoch: bool = True, shuffle: bool = True,
                seed: int = 0, drop_last: bool = False) -> list[int]:
    """The dataset indices DistributedSampler hands `rank` in `epoch` (no process group needed)."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    if set_epoch:
        sampler.set_epoch(epoch)
    return list(sampler)


def padding(n: int, world: int, drop_last: bool = False) -> int:
    """Samples DistributedSampler adds (repeats, > 0) or leaves out (< 0) so every rank gets as many."""
    per_rank = n // world if drop_last else math.ceil(n / world)
    return per_rank * world - n


def duplicates(ids_per_rank: list[list[int]]) -> int:
    """How many reads in one epoch are repeats of a sample some rank already read."""
    reads = [i for ids in ids_per_rank for i in ids]
    return len(reads) - len(set(reads))


def split_exactly(reads: list[list[list[int]]], n: int) -> tuple[int, bool]:
    """Epochs compared, and whether in each the ranks' reads are disjoint and cover ids 0..n-1 once:
    split_exactly([run.result(r) for r in range(2)], n=20), each result one list of ids per epoch."""
    epochs = list(zip(*reads))
    return len(epochs), all(sorted(i for ids in epoch for i in ids) == list(range(n)) for epoch in epochs)


@shown
def plot_shards(n: int, world: int, *, epoch: int = 0, seed: int = 0) -> Figure:
    """What DistributedSampler hands each rank in one epoch, padded (left) and with drop_last (right):

        sharding.plot_shards(n=10, world=4)

    One row per rank, one box per id it reads, in order. The sampler shuffles the ids, pads the list to a multiple
    of `world` by repeating its first ids (or cuts it, with drop_last), and gives rank r every world-th id from r."""
    fig = new_figure(figsize=(11, 0.55 * world + 1.6))
    for ax, drop_last in zip(fig.subplots(1, 2), (False, True)):
        reads = [sampler_ids(n, world, r, epoch, seed=seed, drop_last=drop_last) for r in range(world)]
        rows = [(f"rank {r}", ids, [r + j * world >= n for j in range(len(ids))]) for r, ids in enumerate(reads)]
        if drop_last:
            lost = sorted(set(range(n)) - {i for ids in reads for i in ids})
            rows.append(("never read", lost, [True] * len(lost)))
        for y, (label, ids, marked) in enumerate(rows):
            for x, (i, extra) in enumerate(zip(ids, marked)):
                ax.add_patch(_box(x, y, COLORS[1] if extra else COLORS[0]))
                ax.text(x + 0.5, y + 0.5, str(i), ha="center", va="center", color="white", fontsize=11)
        width = max(len(ids) for _, ids, _ in rows)
        ax.set(xlim=(0, width), ylim=(len(rows), 0), yticks=[y + 0.5 for y in range(len(rows))],
               yticklabels=[label for label, _, _ in rows], xticks=[])
        ax.set_title(f"drop_last=True: {-padding(n, world, True)} ids left out" if drop_last
                     else f"padded: {padding(n, world)} repeated reads (red)", fontsize=10)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"DistributedSampler, {n} ids over {world} ranks, epoch {epoch}")
    return fig


def _box(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle
    return Rectangle((x + 0.05, y + 0.08), 0.9, 0.84, color=color)


def read_epochs(ctx: Any, *, n: int, epochs: int, set_epoch: bool, drop_last: bool = False) -> list[list[int]]:
    """Launch target: iterate a DistributedSampler for `epochs` epochs; return the ids read, one list per epoch."""
    sampler = DistributedSampler(range(n), num_replicas=ctx.world_size, rank=ctx.rank, drop_last=drop_last)
    out = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        out.append(list(sampler))
        ctx.record(epoch, samples=len(out[-1]))
    return out


def uneven_epoch(ctx: Any, *, batches: tuple[int, ...], join: bool, cut_to_shortest: bool = False) -> None:
    """Launch target: rank r has batches[r] batches to train on with DDP, then meets the others at an end-of-epoch
    barrier. Without Join, the rank with more batches waits forever in an all-reduce its peers never join.
    One record per batch a rank really trained (run.df): what the ranks did, whatever they were given.

    join: torch's Join context (ranks that run out shadow the others' collectives). cut_to_shortest: the other
    fix, every rank first agrees on the smallest count (an all-reduce MIN) and trains only that many."""
    from torch.distributed.algorithms.join import Join
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(ctx.rank)
    mine = torch.tensor([batches[ctx.rank]])
    if cut_to_shortest:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    # Join shadows the collectives of ranks that ran out of data, so the others' all-reduces complete.
    with Join([ddp]) if join else contextlib.nullcontext():
        for step in range(int(mine)):
            ctx.heartbeat(step)
            loss = ddp(torch.randn(4, 8, generator=data)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ctx.record(step, loss=loss.item(), samples=4)
    dist.barrier()  # end of epoch: validation, checkpointing, ... everyone meets here


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Shift each 8x8 image by up to one pixel and add a little noise: cheap, label-preserving variety."""
    grid = images.view(-1, 8, 8)
    dx, dy = (torch.randint(-1, 2, (2,), generator=generator)).tolist()
    shifted = torch.roll(grid, shifts=(dy, dx), dims=(1, 2))
    noisy = shifted + 0.05 * torch.randn(shifted.shape, generator=generator)
    return noisy.clamp(0, 1).view(-1, 64)


def shard(rank: int, world: int, *, iid: bool, size: int | None = None) -> torch.Tensor:
    """Indices into the digits training set for `rank`: a random share (iid), or only its own classes
    (rank r of 2 gets digits 0-4 or 5-9: every rank sees a different part of the label space)."""
    x, y, _, _ = digits_data()
    if iid:
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        mine = order[rank::world]
    else:
        classes = torch.arange(10).chunk(world)[rank]
        mine = torch.nonzero(torch.isin(y, classes)).flatten()
    return mine[:size] if size else mine


def train_shards(ctx: Any, *, iid: bool, period: int = 1, steps: int = 60, batch: int = 32, lr: float = 0.05,
                 shard_size: int | None = None, use_augment: bool = False, eval_every: int = 5) -> None:
    """Launch target: an MLP on digits, each rank on its shard; parameters averaged every `period` steps
    (period 1 is what DDP's per-step gradient averaging amounts to for SGD; larger periods are local SGD).
    Records loss and held-out accuracy of the averaged model."""
    torch.manual_seed(0)
    x, y, x_test, y_test = digits_data()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    _average(model, ctx.world_size)  # start from the same weights everywhere
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    mine = shard(ctx.rank, ctx.world_size, iid=iid, size=shard_size)
    data = torch.Generator().manual_seed(100 + ctx.rank)
    for step in range(steps):
        ctx.heartbeat(step)
        pick = mine[torch.randint(len(mine), (batch,), generator=data)]
        inputs = augment(x[pick], data) if use_augment else x[pick]
        loss = F.cross_entropy(model(inputs), y[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        record = {"loss": loss.item(), "lr": lr, "samples": batch, "t_step": 0.0}
        if (step + 1) % period == 0:
            _average(model, ctx.world_size)
        if (step + 1) % eval_every == 0 or step == steps - 1:
            with torch.no_grad():  # held-out accuracy of this rank's current model (equal on all after averaging)
                record["eval_accuracy"] = (model(x_test).argmax(-1) == y_test).float().mean().item()
        ctx.record(step, **record)


def _average(model: torch.nn.Module, world: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data /= world
