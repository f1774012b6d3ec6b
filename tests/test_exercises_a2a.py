"""Build the MoE all-to-all yourself (labkit.exercises.check_a2a): the reference passes on 2 and 3 ranks; the
classic mistakes are caught and named; a stub is reported as not written yet."""
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


def not_written(tokens, expert_of_token, n_experts):
    raise NotImplementedError("dispatch is not written yet")


def test_the_reference_passes_on_2_and_3_ranks(runs_root, no_leftovers):
    report = ex.check_a2a(ex.a2a_dispatch, ex.a2a_combine, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["rows_checked"] > 0
    assert tuple(report.use(ex.a2a_reference)) == (ex.a2a_dispatch, ex.a2a_combine)


def test_each_classic_mistake_is_named(runs_root, no_leftovers):
    for dispatch, combine, words in [(same_splits, ex.a2a_combine, "split sizes were not exchanged"),
                                     (ex.a2a_dispatch, unsorted_combine, "wrong order on combine"),
                                     (unsorted_dispatch, ex.a2a_combine, "tokens lost")]:
        report = ex.check_a2a(dispatch, combine, runs_root=runs_root)
        assert not report.ok and words in report.text(), (dispatch.__name__, combine.__name__, report.text())


def test_a_stub_is_reported_as_not_written_yet(runs_root, no_leftovers, capsys):
    report = ex.check_a2a(not_written, ex.a2a_combine, worlds=(2,), runs_root=runs_root)
    assert report.missing and "NOT WRITTEN YET" in report.text()
    assert report.use(ex.a2a_reference) is ex.a2a_reference
