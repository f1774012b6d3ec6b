"""The sharding exercise's checker (lesson 07): the reference passes on 2 and 3 ranks, correct
loaders written another way pass, and each classic mistake fails naming its cause, with numbers, and
the learner's function."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from labkit.exercises.checks_data import check_epoch_loader, sharded_loader


def test_the_reference_passes_on_2_and_3_ranks(runs_root, no_leftovers):
    report = check_epoch_loader(sharded_loader, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is sharded_loader
    assert [f.check for f in report.findings if f.status == "pass"].count("sharded") == 2


def dropping_the_remainder(dataset, rank, world, epoch, batch_size):
    """Correct another way: the sampler's drop_last, and plain lists of ids for batches."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=7, drop_last=True)
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]


def cut_to_the_shortest(dataset, rank, world, epoch, batch_size):
    """Correct another way: one shuffled list sliced by hand, every rank cut to the fewest
    batches (all-reduce MIN)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
    order = order[rank::world]
    batches = list(order.split(batch_size))
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return batches[:int(count)]


def test_correct_loaders_written_another_way_pass(runs_root, no_leftovers):
    for fn in (dropping_the_remainder, cut_to_the_shortest):
        report = check_epoch_loader(fn, runs_root=runs_root)
        assert report.ok, (fn.__name__, report.text())


def no_sampler(dataset, rank, world, epoch, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


def no_set_epoch(dataset, rank, world, epoch, batch_size):
    return DataLoader(dataset, batch_size=batch_size,
                      sampler=DistributedSampler(dataset, num_replicas=world, rank=rank))


def not_shuffled(dataset, rank, world, epoch, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def seed_per_rank(dataset, rank, world, epoch, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=rank)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def rank_zero_everywhere(dataset, rank, world, epoch, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world, rank=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def sliced_unevenly(dataset, rank, world, epoch, batch_size):
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
    return DataLoader([dataset[i] for i in order[rank::world]], batch_size=batch_size)


def floor_blocks(dataset, rank, world, epoch, batch_size):
    """Contiguous blocks of len // (world + 1): a quarter of the data never read on 3 ranks."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch)).tolist()
    per = len(dataset) // (world + 1)
    return DataLoader(order[rank * per:(rank + 1) * per], batch_size=batch_size)


def test_each_classic_mistake_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, worlds, words in [
            (no_sampler, (2,), ["every rank read all 25 samples", "2x the data",
                                "DistributedSampler"]),
            (no_set_epoch, (2,), ["same order as epoch 0", "set_epoch(epoch)"]),
            (not_shuffled, (3,), ["index order"]),
            (seed_per_rank, (3,), ["shares overlap", "never read", "same seed on every rank"]),
            (rank_zero_everywhere, (2,), ["every rank read the same 13 samples"]),
            (sliced_unevenly, (2,), ["rank 0 gets 4 batches, rank 1 3", "waits forever", "Join"]),
            (floor_blocks, (3,), ["7 of 25 samples never read", "at most 1"])]:
        report = check_epoch_loader(fn, worlds=worlds, runs_root=runs_root)
        text = report.text()
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, text)
        assert all(w in text for w in words), (fn.__name__, text)


def counts_received_first(dataset, rank, world, epoch, batch_size):
    """Agreeing on the batch count point to point, every rank receiving first: a deadlock."""
    theirs = torch.zeros(1)
    dist.recv(theirs, src=(rank + 1) % world)
    dist.send(torch.ones(1), dst=(rank - 1) % world)
    return sharded_loader(dataset, rank, world, epoch, batch_size)


def test_a_deadlock_is_reported_within_seconds_at_the_learners_line(runs_root, no_leftovers):
    report = check_epoch_loader(counts_received_first, worlds=(2,), timeout=3, runs_root=runs_root)
    text = report.text()
    assert not report.ok and report.blamed == ["counts_received_first"], text
    assert "made no progress" in text and "in counts_received_first" in text, text
    assert "waits in recv" in text, text


def test_the_stub_is_not_written_yet_and_the_reference_is_used(runs_root, no_leftovers):
    def epoch_loader(dataset, rank, world, epoch, batch_size):
        raise NotImplementedError("epoch_loader is not written yet")

    report = check_epoch_loader(epoch_loader, worlds=(2,), runs_root=runs_root)
    assert not report.ok and report.missing and not report.failures, report.text()
    assert "epoch_loader is not written yet" in report.text()
    assert report.use(sharded_loader) is sharded_loader
