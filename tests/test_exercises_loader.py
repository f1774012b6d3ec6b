"""Lesson 05's exercise: make_loader(dataset, batch_size, rank, world), a rank's DataLoader. The
checker runs it on 2 gloo ranks over 2 epochs of samples that record the process that loaded them,
and names each classic mistake from what the ranks saw, never from a timing."""
from __future__ import annotations

from torch.utils.data import DataLoader, DistributedSampler

from labkit.exercises.checks_loader import check_loader, rank_loader


def test_the_reference_passes_and_is_used(runs_root, no_leftovers):
    report = check_loader(rank_loader, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["num_workers"] == 2 and report.use(None) is rank_loader


def _sampler(ds, rank, world):
    return DistributedSampler(ds, num_replicas=world, rank=rank)


def no_workers(ds, batch_size, rank, world):
    return DataLoader(ds, batch_size, sampler=_sampler(ds, rank, world))


def no_sampler(ds, batch_size, rank, world):
    return DataLoader(ds, batch_size, shuffle=True, num_workers=2, persistent_workers=True)


def restarted_each_epoch(ds, batch_size, rank, world):
    return DataLoader(ds, batch_size, sampler=_sampler(ds, rank, world), num_workers=2)


def rank_0_shard_everywhere(ds, batch_size, rank, world):
    return DataLoader(ds, batch_size, sampler=_sampler(ds, 0, world), num_workers=2,
                      persistent_workers=True)


def wrong_batch_size(ds, batch_size, rank, world):
    return DataLoader(ds, 2 * batch_size, sampler=_sampler(ds, rank, world), num_workers=2,
                      persistent_workers=True)


def unshuffled(ds, batch_size, rank, world):
    return DataLoader(ds, batch_size, num_workers=2, persistent_workers=True,
                      sampler=DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False))


def returns_an_iterator(ds, batch_size, rank, world):
    return iter(DataLoader(ds, batch_size, sampler=_sampler(ds, rank, world)))


def test_each_classic_mistake_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, check, words in [
            (no_workers, "workers", "own process loaded every one of its 64 samples"),
            (no_sampler, "shards", "every rank loads everything"),
            (restarted_each_epoch, "persistent", "workers were stopped and started again"),
            (rank_0_shard_everywhere, "shards", "the ranks loaded the same 32 samples"),
            (wrong_batch_size, "loader", "it was asked for batch_size=4"),
            (unshuffled, "order", "the same order in every epoch"),
            (returns_an_iterator, "loader", "return the DataLoader itself")]:
        report = check_loader(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert report.status(check) == "fail" and words in report.text(), (fn.__name__,
                                                                           report.text())


def pinned_without_cuda(ds, batch_size, rank, world):
    return DataLoader(ds, batch_size, sampler=_sampler(ds, rank, world), num_workers=2,
                      persistent_workers=True, pin_memory=True)


def test_pin_memory_without_cuda_is_a_note_with_pytorchs_warning(runs_root, no_leftovers):
    report = check_loader(pinned_without_cuda, runs_root=runs_root)
    assert report.ok and report.status("pin_memory") == "note", report.text()
    assert "pin_memory=True without CUDA" in report.text()
    assert "no accelerator is found" in report.text(), report.text()


def one_worker_from_the_group(ds, batch_size, rank, world):
    """Written another way: the sampler's ranks read from the process group, one worker."""
    return DataLoader(ds, batch_size=batch_size, sampler=DistributedSampler(ds), num_workers=1,
                      persistent_workers=True)


def test_a_loader_written_another_way_passes(runs_root, no_leftovers):
    report = check_loader(one_worker_from_the_group, runs_root=runs_root)
    assert report.ok, report.text()


def make_loader(ds, batch_size, rank, world):
    raise NotImplementedError("make_loader is not written yet")


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(runs_root, no_leftovers,
                                                                  monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    report = check_loader(make_loader, runs_root=runs_root)
    assert not report.ok and not report.failures
    assert "make_loader is not written yet" in report.text()
    assert report.use(rank_loader) is rank_loader
