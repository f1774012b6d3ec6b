"""Build tensor parallelism yourself (labkit.exercises.check_tp): the reference passes on 2 ranks; planted mistakes
are caught and named; a stub is reported as not written yet."""
from __future__ import annotations

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


class NotWritten(nn.Module):
    def __init__(self, full):
        raise NotImplementedError("NotWritten.__init__ is not written yet")


def test_the_reference_passes(runs_root, no_leftovers):
    report = ex.check_tp(*ex.TP_REFERENCE, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["forward_allreduces"] == 1 and report.measured["backward_allreduces"] == 1
    assert report.use(None) == ex.TP_REFERENCE and "ColumnParallelLinear and RowParallelLinear" in report.text()


def test_planted_mistakes_are_named(runs_root, no_leftovers):
    for column, row, words in [(ColumnParallelLinear, RowWithoutAllReduce, "its own partial sum (no all-reduce"),
                               (ColumnParallelLinear, RowBiasOnEveryRank, "the bias is counted 2 times"),
                               (ColumnRankZerosSlice, RowParallelLinear, "wrong slice on rank 1: it computed rank 0's"),
                               (ColumnWithoutBackwardAllReduce, RowParallelLinear, "backward must all-reduce it")]:
        report = ex.check_tp(column, row, runs_root=runs_root)
        assert not report.ok and words in report.text(), (column.__name__, row.__name__, report.text())


def test_a_stub_is_reported_as_not_written_yet(runs_root, no_leftovers):
    report = ex.check_tp(NotWritten, RowParallelLinear, runs_root=runs_root)
    assert report.missing and "NOT WRITTEN YET" in report.text(), report.text()
    assert report.use(ex.TP_REFERENCE) == ex.TP_REFERENCE


