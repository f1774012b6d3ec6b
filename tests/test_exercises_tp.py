"""Build tensor parallelism yourself (labkit.exercises.check_tp): the reference passes on 2 ranks; planted mistakes
are caught, blamed on the learner's function that made them and named; a correct solution written with other
collectives passes; a stub is reported as not written yet."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import exercises as ex
from labkit.exercises.checks_tp import ColumnParallelLinear, RowParallelLinear


class RowWithoutAllReduce(RowParallelLinear):
    def forward(self, x):
        return F.linear(x, self.weight) + self.bias            # each rank keeps its partial sum


class RowBiasOnEveryRank(RowParallelLinear):
    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)              # the bias before the sum: counted twice
        return ex.checks_tp._Sum.apply(out)


class ColumnRankZerosSlice(ColumnParallelLinear):
    def __init__(self, full):
        nn.Module.__init__(self)
        k = full.out_features // dist.get_world_size()
        self.weight = nn.Parameter(full.weight.detach()[:k].clone())   # rank 0's rows on every rank
        self.bias = nn.Parameter(full.bias.detach()[:k].clone())


class ColumnWithoutBackwardAllReduce(ColumnParallelLinear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def summed(t):
    total = t.detach().clone()
    dist.all_reduce(total)
    return total


class ColumnHookOnX(ColumnParallelLinear):
    """The issue's case: the hook sits on x itself, so it sums x's whole gradient (the residual's share too); an MLP
    without a residual cannot tell."""

    def forward(self, x):
        x.register_hook(summed)
        return F.linear(x, self.weight, self.bias)


class ColumnHookTwice(ColumnParallelLinear):
    def forward(self, x):
        x = x.view_as(x)
        x.register_hook(summed)
        x.register_hook(summed)                                 # summed twice: 2x every rank's part
        return F.linear(x, self.weight, self.bias)


class ColumnHookRaises(ColumnParallelLinear):
    def forward(self, x):
        def broken_hook(grad):
            raise ValueError("no all-reduce here")
        x = x.view_as(x)
        x.register_hook(broken_hook)
        return F.linear(x, self.weight, self.bias)


class RowSummedTwice(RowParallelLinear):
    def forward(self, x):
        partial = F.linear(x, self.weight)
        return partial + (summed(summed(partial)) - partial).detach() + self.bias


class RowWrongColumns(RowParallelLinear):
    def __init__(self, full):
        nn.Module.__init__(self)
        k = full.in_features // dist.get_world_size()
        self.weight = nn.Parameter(full.weight.detach()[:, -k:].clone())   # the last rank's columns everywhere
        self.bias = nn.Parameter(full.bias.detach().clone())


class RowByAllGather(RowParallelLinear):
    """Correct, written another way: every rank's partial output gathered, then summed."""

    def forward(self, x):
        partial = F.linear(x, self.weight)
        parts = [torch.empty_like(partial) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, partial.detach().contiguous())
        return partial + (sum(parts) - partial).detach() + self.bias


class NotWritten(nn.Module):
    def __init__(self, full):
        raise NotImplementedError("NotWritten.__init__ is not written yet")


def test_the_reference_passes(runs_root, no_leftovers):
    report = ex.check_tp(*ex.TP_REFERENCE, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["forward_allreduces"] == 1 and report.measured["backward_allreduces"] == 1
    assert report.use(None) == ex.TP_REFERENCE and "ColumnParallelLinear and RowParallelLinear" in report.text()


def test_planted_mistakes_are_named(runs_root, no_leftovers):
    for column, row, words in [
            (ColumnParallelLinear, RowWithoutAllReduce, "its own partial sum (no collective ran in it)"),
            (ColumnParallelLinear, RowBiasOnEveryRank, "the bias is counted 2 times"),
            (ColumnRankZerosSlice, RowParallelLinear, "rank 1: it keeps rank 0's rows"),
            (ColumnWithoutBackwardAllReduce, RowParallelLinear, "backward must sum it over the ranks")]:
        report = ex.check_tp(column, row, runs_root=runs_root)
        assert not report.ok and words in report.text(), (column.__name__, row.__name__, report.text())


def test_each_failure_blames_the_function_that_made_it_and_names_the_cause(runs_root, no_leftovers):
    for column, row, blamed, words in [
            (ColumnHookOnX, RowParallelLinear, "ColumnHookOnX.forward → summed", "The hook sits on x itself"),
            (ColumnHookTwice, RowParallelLinear, "ColumnHookTwice.forward → summed",
             "2·(every rank's part, summed)"),
            (ColumnHookRaises, RowParallelLinear, "ColumnHookRaises.forward.<locals>.broken_hook", "ValueError"),
            (ColumnParallelLinear, RowSummedTwice, "RowSummedTwice.forward → summed",
             "2·(the sum over the ranks of their partial outputs) + 1·(the bias)"),
            (ColumnParallelLinear, RowWrongColumns, "RowWrongColumns.__init__", "it keeps rank 1's columns"),
            (ColumnParallelLinear, RowWithoutAllReduce, "RowWithoutAllReduce.forward", "its own partial sum")]:
        report = ex.check_tp(column, row, runs_root=runs_root)
        assert not report.ok and report.blamed == [blamed], (blamed, report.text())
        assert words in report.text(), (blamed, report.text())


def test_a_correct_layer_written_with_other_collectives_passes(runs_root, no_leftovers):
    report = ex.check_tp(ColumnParallelLinear, RowByAllGather, runs_root=runs_root)
    assert report.ok, report.text()


def test_a_stub_is_reported_as_not_written_yet(runs_root, no_leftovers):
    report = ex.check_tp(NotWritten, RowParallelLinear, runs_root=runs_root)
    assert report.missing and "NOT WRITTEN YET" in report.text(), report.text()
    assert report.use(ex.TP_REFERENCE) == ex.TP_REFERENCE


