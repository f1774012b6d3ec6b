"""Sharding: what DistributedSampler hands each rank, and uneven inputs that must not hang the suite."""
import functools
import time

import pytest

import labkit
from labkit.tricks import sharding

from .conftest import leftover_processes


def test_without_set_epoch_every_epoch_replays_the_same_order():
    assert sharding.sampler_ids(20, 2, 0, 0, set_epoch=False) == sharding.sampler_ids(20, 2, 0, 5, set_epoch=False)
    assert sharding.sampler_ids(20, 2, 0, 0) != sharding.sampler_ids(20, 2, 0, 1)


@pytest.mark.parametrize("n, world", [(10, 4), (12, 4), (7, 3), (1, 2)])
def test_padding_and_duplicates_agree_with_the_sampler(n, world):
    reads = [sharding.sampler_ids(n, world, r, 0) for r in range(world)]
    assert sharding.duplicates(reads) == sharding.padding(n, world)
    kept = [sharding.sampler_ids(n, world, r, 0, drop_last=True) for r in range(world)]
    assert sharding.duplicates(kept) == 0
    assert n - len({i for ids in kept for i in ids}) == -sharding.padding(n, world, drop_last=True)


def test_skewed_shards_split_the_classes_and_iid_shards_split_the_images():
    _, y, _, _ = sharding.digits_data()
    skewed = [set(y[sharding.shard(r, 2, iid=False)].tolist()) for r in range(2)]
    assert skewed == [{0, 1, 2, 3, 4}, {5, 6, 7, 8, 9}]
    iid = [set(sharding.shard(r, 2, iid=True).tolist()) for r in range(2)]
    assert not iid[0] & iid[1] and len(iid[0] | iid[1]) == len(y)


def test_uneven_inputs_without_join_are_reported_as_a_hang_in_time_and_nothing_is_left(runs_root, no_leftovers):
    timeout = 3.0
    labkit.launch(functools.partial(sharding.uneven_epoch, batches=(1, 1), join=False), world_size=2,
                  runs_root=runs_root, echo=False)  # pay the one-off imports before the clock starts
    started = time.monotonic()
    with pytest.raises(labkit.RankFailure) as info:
        labkit.launch(functools.partial(sharding.uneven_epoch, batches=(6, 4), join=False), world_size=2,
                      timeout=timeout, runs_root=runs_root, echo=False)
    assert time.monotonic() - started < timeout + 5
    states = {s.rank: s for s in info.value.statuses}
    assert info.value.reason == "hung" and states[0].step == 4 and states[1].recorded == 3
    assert not leftover_processes()


def batches_trained(run):
    """What lesson 07 asserts on: the batches each rank really trained, one record each."""
    return run.df.groupby("rank").size().tolist()


def test_join_runs_uneven_inputs_to_the_end(runs_root, no_leftovers):
    run = labkit.launch(functools.partial(sharding.uneven_epoch, batches=(5, 2), join=True), world_size=2,
                        timeout=20, runs_root=runs_root, echo=False)
    assert batches_trained(run) == [5, 2]


def test_cutting_to_the_shortest_trains_fewer_batches_and_lesson_07s_join_assert_sees_it(runs_root, no_leftovers):
    # Also finishes, without Join: rank 0's last batches are never trained. The records show the cut; the value the
    # function used to return (the batches it was given) would have said 5 and 2 all the same.
    run = labkit.launch(functools.partial(sharding.uneven_epoch, batches=(5, 2), join=False, cut_to_shortest=True),
                        world_size=2, timeout=20, runs_root=runs_root, echo=False)
    assert batches_trained(run) == [2, 2] != [5, 2]


def test_split_exactly_accepts_disjoint_covering_shares_and_rejects_overlap_or_gaps():
    good = [[[0, 2], [3, 1]], [[1, 3], [0, 2]]]            # two ranks, two epochs each
    assert sharding.split_exactly(good, n=4) == (2, True)
    assert sharding.split_exactly([[[0, 2]], [[0, 3]]], n=4) == (1, False)   # 0 read twice, 1 never
    reads = [[sharding.sampler_ids(10, 4, r, 0)] for r in range(4)]
    assert sharding.split_exactly(reads, n=10) == (1, False)                 # padded: repeats


def test_plot_shards_draws_every_rank_and_the_ids_left_out():
    fig = sharding.plot_shards.__wrapped__(10, 4)    # the figure itself, not shown
    padded, dropped = fig.axes
    assert [t.get_text() for t in padded.get_yticklabels()] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert [t.get_text() for t in dropped.get_yticklabels()][-1] == "never read"
    assert len(padded.texts) == 12 and len(dropped.texts) == 8 + 2           # 3 ids per rank; 2 each + 2 lost
