"""A rank's DataLoader that keeps the step fed (lesson 05): its own shard, workers that last.

    report = check_loader(make_loader)      # make_loader(dataset, batch_size, rank, world)
    make_loader = report.use(rank_loader)   # yours if it passed

The checker runs the learner's function on 2 gloo ranks. Each rank builds its loader over
PidSamples, a dataset whose __getitem__ takes a little while and returns the sample's index and the
id of the process that loaded it, then goes through two epochs as a training loop does
(`sampler.set_epoch` first, where the sampler has it). What each rank saw is judged, never how long
it took:

    loader      a DataLoader was returned, and it gives batches of batch_size
    shards      in each epoch the ranks' samples do not overlap and leave none out (without a
                DistributedSampler every rank loads everything; with another rank's, the same shard)
    order       each rank's shard comes in a new order each epoch (shuffled, and set_epoch called)
    workers     no sample was loaded by the rank's own process (num_workers=0: the step waits while
                the rank makes each batch itself)
    persistent  epoch 1's samples came from the processes that made epoch 0's (new process ids: the
                workers were stopped and started again at the epoch)
    pin_memory  asked for where CUDA is, not where it is not (a note, not a failure: unpinned
                batches are correct, and pinning without CUDA only warns)
"""
from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .learner import learner_part, run_checked
from .report import Report

SIZE = 64           # samples: 32 per rank, 8 batches of 4 per epoch, enough for 8 workers each
BATCH = 4
EPOCHS = 2
SLOW_S = 0.001      # each sample's wait: a stand-in for decoding; the checks never time it


class PidSamples(Dataset):
    """`size` samples; sample i is (i, the id of the process that loaded it), after SLOW_S."""

    def __init__(self, size: int = SIZE):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SLOW_S)
        return torch.tensor(index), torch.tensor(os.getpid())


def rank_loader(dataset: Dataset, batch_size: int, rank: int, world: int) -> DataLoader:
    """The reference: this rank's shard (DistributedSampler), made by 2 worker processes that live
    across epochs, pinned only where CUDA can use it."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=2,
                      pin_memory=torch.cuda.is_available(), persistent_workers=True)


def _shut(loader: DataLoader) -> None:
    """Stop persistent workers now, not when the rank exits: no process is left behind."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def _drive(ctx: Any, fn: Callable, size: int, batch_size: int, epochs: int,
           name: str) -> dict[str, Any]:
    with learner_part(ctx, name):
        loader = fn(PidSamples(size), batch_size, ctx.rank, ctx.world_size)
    if not isinstance(loader, DataLoader):
        return {"returned": type(loader).__name__}
    seen, sizes = [], []
    with warnings.catch_warnings(record=True) as said, learner_part(ctx, name):
        warnings.simplefilter("always")
        for epoch in range(epochs):
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            for step, (index, pid) in enumerate(loader):
                ctx.heartbeat(epoch * 1000 + step)
                seen += [(epoch, i, p) for i, p in zip(index.tolist(), pid.tolist())]
                sizes.append(len(index))
    _shut(loader)
    return {"returned": "DataLoader", "seen": seen, "sizes": sizes, "rank pid": os.getpid(),
            "pin_memory": bool(loader.pin_memory), "cuda": torch.cuda.is_available(),
            "num_workers": loader.num_workers, "sampler": type(loader.sampler).__name__,
            "warnings": [str(w.message) for w in said if "pin_memory" in str(w.message)]}


def check_loader(fn: Callable, *, world: int = 2, size: int = SIZE, batch_size: int = BATCH,
                 epochs: int = EPOCHS, timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Run `fn(dataset, batch_size, rank, world)` on `world` gloo ranks, go through `epochs` epochs
    of the loader it returns, and judge what each rank saw:  check_loader(make_loader).ok."""
    name = getattr(fn, "__name__", "your loader")
    report = Report(f"{name}: a rank's DataLoader, on {world} gloo ranks over {epochs} epochs",
                    implementation=fn)
    drive = functools.partial(_drive, fn=fn, size=size, batch_size=batch_size, epochs=epochs,
                              name=name)
    outcomes = run_checked(report, drive, world_size=world, timeout=timeout, name=f"check-{name}",
                           runs_root=runs_root,
                           hang_hint="A loader's workers that never hand back a batch stop the "
                                     "rank: check the dataset and the sampler you gave it.")
    if outcomes is None:
        return report
    if not _loader(report, outcomes, batch_size, name):
        return report
    if _shards(report, outcomes, size, epochs, name) and epochs > 1:
        _order(report, outcomes, name)
    if _workers(report, outcomes, name):
        _persistent(report, outcomes, name)
    _pin_memory(report, outcomes[0])
    report.measured.update({"num_workers": outcomes[0]["num_workers"],
                            "sampler": outcomes[0]["sampler"]})
    return report


def _loader(report: Report, outcomes: list[dict], batch_size: int, name: str) -> bool:
    returned = outcomes[0]["returned"]
    if returned != "DataLoader":
        report.add("loader", "fail", f"{name} returned a {returned}: return the DataLoader itself",
                   part=name)
        return False
    wrong = sorted({s for out in outcomes for s in out["sizes"][:-1]} - {batch_size})
    if wrong or not outcomes[0]["sizes"]:
        report.add("loader", "fail", f"batches of {wrong or 'nothing'}: it was asked for "
                                     f"batch_size={batch_size}", part=name)
        return False
    report.add("loader", "pass", f"a DataLoader giving batches of {batch_size}")
    return True


def _shards(report: Report, outcomes: list[dict], size: int, epochs: int, name: str) -> bool:
    world = len(outcomes)
    for epoch in range(epochs):
        per_rank = [[i for e, i, _ in out["seen"] if e == epoch] for out in outcomes]
        if sorted(i for rank in per_rank for i in rank) == list(range(size)):
            continue
        counts = ", ".join(f"rank {r} {len(set(rank))}" for r, rank in enumerate(per_rank))
        if all(sorted(set(rank)) == list(range(size)) for rank in per_rank):
            why = (f"every rank loads everything: each rank loaded all {size} samples of epoch "
                   f"{epoch}. Give the DataLoader a DistributedSampler(dataset, "
                   "num_replicas=world, rank=rank): each rank then loads its own 1/world")
        elif all(set(rank) == set(per_rank[0]) for rank in per_rank):
            why = (f"the ranks loaded the same {len(set(per_rank[0]))} samples in epoch {epoch}: "
                   "each rank took the same shard; pass the sampler this rank (rank=rank)")
        else:
            why = (f"in epoch {epoch} the ranks' samples ({counts} distinct, of {size}) overlap or "
                   f"leave samples out: a DistributedSampler with num_replicas={world} and each "
                   "rank's own rank gives each sample to exactly one rank")
        report.add("shards", "fail", why, part=name)
        return False
    report.add("shards", "pass", f"each epoch, each of the {size} samples went to exactly one of "
                                 f"the {world} ranks")
    return True


def _order(report: Report, outcomes: list[dict], name: str) -> bool:
    for rank, out in enumerate(outcomes):
        orders = [[i for e, i, _ in out["seen"] if e == epoch]
                  for epoch in sorted({e for e, _, _ in out["seen"]})]
        if any(order == orders[0] for order in orders[1:]):
            report.add("order", "fail", f"rank {rank} got its shard in the same order in every "
                                        "epoch: the sampler does not shuffle (shuffle=False); "
                                        "shuffled, and told the epoch (set_epoch), it gives a new "
                                        "order each epoch, the same on every rank", part=name)
            return False
    report.add("order", "pass", "a new order each epoch (the sampler shuffles, set_epoch)")
    return True


def _workers(report: Report, outcomes: list[dict], name: str) -> bool:
    for rank, out in enumerate(outcomes):
        own = sum(1 for _, _, pid in out["seen"] if pid == out["rank pid"])
        if own:
            how_many = "every one" if own == len(out["seen"]) else f"{own}"
            report.add("workers", "fail", f"rank {rank}'s own process loaded {how_many} of its "
                                          f"{len(out['seen'])} samples (num_workers="
                                          f"{out['num_workers']}): the step waits while the rank "
                                          "makes each batch; set num_workers > 0 so that worker "
                                          "processes make them ahead", part=name)
            return False
    pids = {len({pid for e, _, pid in out["seen"] if e == 0}) for out in outcomes}
    report.add("workers", "pass", f"worker processes made every sample, not the ranks "
                                  f"({'/'.join(map(str, sorted(pids)))} per rank in epoch 0)")
    return True


def _persistent(report: Report, outcomes: list[dict], name: str) -> bool:
    for rank, out in enumerate(outcomes):
        by_epoch = [{p for e, _, p in out["seen"] if e == epoch}
                    for epoch in sorted({e for e, _, _ in out["seen"]})]
        first = by_epoch[0]
        for epoch, pids in enumerate(by_epoch[1:], start=1):
            if pids <= first:
                continue
            new = len(pids - first)
            report.add("persistent", "fail", f"rank {rank}'s epoch {epoch} came from {new} new "
                                             f"process{'es' * (new != 1)}, not epoch 0's: the "
                                             "workers were stopped and started again at the epoch; "
                                             "persistent_workers=True keeps them", part=name)
            return False
    report.add("persistent", "pass", "the same worker processes served every epoch")
    return True


def _pin_memory(report: Report, out: dict) -> None:
    if out["pin_memory"] == out["cuda"]:
        report.add("pin_memory", "pass", "pin_memory is on where CUDA is" if out["cuda"] else
                   "pin_memory is off, and there is no CUDA to pin for")
    elif out["pin_memory"]:
        said = f" (PyTorch said: {out['warnings'][0]})" if out["warnings"] else ""
        report.add("pin_memory", "note", "pin_memory=True without CUDA: nothing is pinned and "
                                         f"PyTorch warns{said}; ask for it where "
                                         "torch.cuda.is_available()")
    else:
        report.add("pin_memory", "note", "CUDA is here and pin_memory is off: a pinned batch "
                                         "copies to the GPU alongside compute "
                                         "(pin_memory=torch.cuda.is_available())")
