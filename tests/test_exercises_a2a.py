"""Build the MoE all-to-all yourself (labkit.exercises.check_a2a): the reference passes on 2 and 3 ranks; the
classic mistakes are caught, named and blamed on dispatch or combine, whichever made them; a correct pair written
with other collectives passes; a stub is reported as not written yet."""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit import exercises as ex


def same_splits(tokens, expert_of_token, n_experts):
    """Splits not exchanged: assumes each rank receives what it sends."""
    world = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)
    send = torch.bincount(expert_of_token, minlength=n_experts).view(world, -1).sum(1).tolist()
    received = tokens.new_empty(sum(send), tokens.shape[1])
    dist.all_to_all_single(received, tokens[order], send, send)
    return received, (order, send, send)


def unsorted_combine(processed, plan):
    """Wrong order on combine: the rows come back sorted by expert, and stay so."""
    order, send, recv = plan
    back = processed.new_empty(sum(send), processed.shape[1])
    dist.all_to_all_single(back, processed, send, recv)
    return back


def unsorted_dispatch(tokens, expert_of_token, n_experts):
    """Tokens lost: the rows are sent in their own order, not grouped by destination."""
    world = dist.get_world_size()
    send = torch.bincount(expert_of_token, minlength=n_experts).view(world, -1).sum(1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    received = tokens.new_empty(int(recv.sum()), tokens.shape[1])
    dist.all_to_all_single(received, tokens, recv.tolist(), send.tolist())
    return received, (torch.arange(len(tokens)), send.tolist(), recv.tolist())


def combine_same_sizes(processed, plan):
    """Combine assumes each rank gets back what it sent: right on "even", broken on "uneven"."""
    order, _, recv = plan
    back = processed.new_empty(sum(recv), processed.shape[1])
    dist.all_to_all_single(back, processed, recv, recv)
    out = torch.empty_like(back)
    out[order] = back
    return out


def combine_raises_on_uneven(processed, plan):
    """The issue's case: a failure inside combine, on "uneven" only, which must not be blamed on dispatch."""
    _, send, recv = plan
    if sum(send) != sum(recv):
        raise ValueError("combine cannot handle this")
    return ex.a2a_combine(processed, plan)


def gather_dispatch(tokens, expert_of_token, n_experts):
    """Correct, written another way: every rank's rows gathered (padded to the longest); each keeps its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = torch.tensor([len(tokens)])
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    longest = max(int(c) for c in counts)

    def gathered(t):
        padded = t.new_zeros(longest, *t.shape[1:])
        padded[:len(t)] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        return [part[:int(c)] for part, c in zip(parts, counts)]

    keep = [e // (n_experts // world) == rank for e in gathered(expert_of_token)]
    return torch.cat([rows[k] for rows, k in zip(gathered(tokens), keep)]), (keep, counts)


def reduce_combine(processed, plan):
    """Correct, written another way: each rank writes its processed rows into every rank's token slots, and one
    all_reduce sums them (each slot is written by one rank only)."""
    keep, counts = plan
    every = processed.new_zeros(sum(int(c) for c in counts), processed.shape[1])
    start = used = 0
    for k in keep:
        slots = k.nonzero().flatten()
        every[start + slots] = processed[used:used + len(slots)]
        start, used = start + len(k), used + len(slots)
    dist.all_reduce(every)
    begin = sum(int(c) for c in counts[:dist.get_rank()])
    return every[begin:begin + int(counts[dist.get_rank()])]


def not_written(tokens, expert_of_token, n_experts):
    raise NotImplementedError("dispatch is not written yet")


def test_the_reference_passes_on_2_and_3_ranks(runs_root, no_leftovers):
    report = ex.check_a2a(ex.a2a_dispatch, ex.a2a_combine, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["rows_checked"] > 0
    assert tuple(report.use(ex.a2a_reference)) == (ex.a2a_dispatch, ex.a2a_combine)


def test_each_classic_mistake_is_named(runs_root, no_leftovers):
    for dispatch, combine, words in [(same_splits, ex.a2a_combine, "must not assume that a rank receives"),
                                     (ex.a2a_dispatch, unsorted_combine, "wrong order on combine"),
                                     (unsorted_dispatch, ex.a2a_combine, "tokens lost")]:
        report = ex.check_a2a(dispatch, combine, runs_root=runs_root)
        assert not report.ok and words in report.text(), (dispatch.__name__, combine.__name__, report.text())


def test_each_failure_blames_dispatch_or_combine_whichever_made_it(runs_root, no_leftovers):
    for dispatch, combine, blamed, words in [
            (same_splits, ex.a2a_combine, "same_splits", "dispatch is right when every rank receives as many"),
            (ex.a2a_dispatch, combine_same_sizes, "combine_same_sizes", "must not assume that a rank gets back"),
            (ex.a2a_dispatch, combine_raises_on_uneven, "combine_raises_on_uneven",
             "your combine_raises_on_uneven raised ValueError"),
            (unsorted_dispatch, ex.a2a_combine, "unsorted_dispatch", "The number of rows was right but not the rows"),
            (ex.a2a_dispatch, unsorted_combine, "unsorted_combine", "not in its tokens' order")]:
        report = ex.check_a2a(dispatch, combine, runs_root=runs_root)
        assert not report.ok and report.blamed == [blamed], (blamed, report.text())
        assert words in report.text(), (blamed, report.text())


def test_a_correct_pair_written_with_all_gather_and_all_reduce_passes(runs_root, no_leftovers):
    report = ex.check_a2a(gather_dispatch, reduce_combine, runs_root=runs_root)
    assert report.ok, report.text()


def test_a_stub_is_reported_as_not_written_yet(runs_root, no_leftovers, capsys):
    report = ex.check_a2a(not_written, ex.a2a_combine, worlds=(2,), runs_root=runs_root)
    assert report.missing and "NOT WRITTEN YET" in report.text()
    assert report.use(ex.a2a_reference) is ex.a2a_reference
