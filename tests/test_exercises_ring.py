"""Build ring attention yourself (labkit.exercises.check_ring): the reference passes on 2 and 4 ranks; each classic
mistake is caught and named; a stub is reported as not written yet."""
from __future__ import annotations

import torch

from labkit import exercises as ex
from labkit.training.parallel import context as cp


def _loop(q, k, v, ring, merge, source=lambda ring, step: (ring.rank - step) % ring.size):
    acc, kv, last = None, torch.stack((k, v)), None
    for step in range(ring.size):
        last = ring.block(q, kv[0], kv[1], source(ring, step))
        acc = merge(acc, last)
        if step < ring.size - 1:
            kv = ring.shift(kv)
    return acc[0] if last is not None else acc[0] + 0 * kv.sum()


def averaged(q, k, v, ring):
    def merge(acc, new):
        if acc is None or new is None:
            return acc or new
        return (acc[0] + new[0]) / 2, torch.logaddexp(acc[1], new[1])
    return _loop(q, k, v, ring, merge)


def textbook(q, k, v, ring):
    def merge(acc, new):
        if acc is None or new is None:
            return acc or new
        wa, wb = acc[1].exp(), new[1].exp()
        return (wa * acc[0] + wb * new[0]) / (wa + wb), (wa + wb).log()
    return _loop(q, k, v, ring, merge)


def wrong_owner(q, k, v, ring):
    return _loop(q, k, v, ring, cp.merge, source=lambda ring, step: (ring.rank + step) % ring.size)


def untied(q, k, v, ring):
    """The natural loop: the last shift's K and V are left out of the output on a rank whose last block is hidden."""
    acc, kv = None, torch.stack((k, v))
    for step in range(ring.size):
        acc = cp.merge(acc, ring.block(q, kv[0], kv[1], (ring.rank - step) % ring.size))
        if step < ring.size - 1:
            kv = ring.shift(kv)
    return acc[0]


def not_written(q, k, v, ring):
    raise NotImplementedError("not_written is not written yet")


def test_the_reference_passes_on_2_and_4_ranks(runs_root, no_leftovers):
    report = ex.check_ring(ex.ring_attention, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["worst_error"] < 1e-5


def test_each_classic_mistake_is_named(runs_root, no_leftovers):
    for mistake, words in [(averaged, "rank 0's output is right and the other ranks' are wrong"),
                           (textbook, "exp(lse) of each block, which overflows"),
                           (wrong_owner, "right without a causal mask, wrong with one")]:
        report = ex.check_ring(mistake, worlds=(4,), runs_root=runs_root)
        assert not report.ok and words in report.text(), (mistake.__name__, report.text())


def test_the_last_shift_left_out_of_the_graph_hangs_and_is_named(runs_root, no_leftovers):
    report = ex.check_ring(untied, worlds=(2,), timeout=3.0, runs_root=runs_root)
    assert not report.ok and "made no progress" in report.text(), report.text()
    assert "never used the last shift's K and V" in report.text(), report.text()


def test_a_stub_is_reported_as_not_written_yet(runs_root, no_leftovers):
    report = ex.check_ring(not_written, worlds=(2,), runs_root=runs_root)
    assert report.missing and "NOT WRITTEN YET" in report.text()
