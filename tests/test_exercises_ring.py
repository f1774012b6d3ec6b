"""Build ring attention yourself (labkit.exercises.check_ring): the reference passes on 2 and 4 ranks; each classic
mistake is caught and blamed on the step of the learner's function that makes it (the shift, ring.block's inputs,
the merge, backward); correct solutions written another way pass, or are told which requirement they miss; a hang
names the learner's line; a stub is reported as not written yet."""
from __future__ import annotations

from pathlib import Path

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


def shift_not_kept(q, k, v, ring):
    """The shift's result is thrown away: every block is this rank's own K and V."""
    acc, kv = None, torch.stack((k, v))
    for step in range(ring.size):
        acc = cp.merge(acc, ring.block(q, kv[0], kv[1], (ring.rank - step) % ring.size))
        if step < ring.size - 1:
            acc = (acc[0] + 0 * ring.shift(kv).sum(), acc[1])
    return acc[0]


def swapped(q, k, v, ring):
    return _loop(q, v, k, ring, cp.merge)


def plus_tie(q, k, v, ring):
    """The merge is right; the tie adds kv.sum() itself, not 0 times it."""
    acc, kv = None, torch.stack((k, v))
    for step in range(ring.size):
        acc = cp.merge(acc, ring.block(q, kv[0], kv[1], (ring.rank - step) % ring.size))
        if step < ring.size - 1:
            kv = ring.shift(kv)
    return acc[0] + kv.sum()


def detached_lse(q, k, v, ring):
    """Right values; the weights are computed from detached lse, so the gradient through them is lost."""
    def merge(acc, new):
        if acc is None or new is None:
            return acc or new
        lse = torch.logaddexp(acc[1], new[1]).detach()
        return (acc[1].detach() - lse).exp() * acc[0] + (new[1].detach() - lse).exp() * new[0], lse
    return _loop(q, k, v, ring, merge)


def separate_shifts(q, k, v, ring):
    """Correct, written another way: K and V shifted one at a time, blocks merged by a softmax over their lse."""
    outs, lses = [], []
    for step in range(ring.size):
        got = ring.block(q, k, v, (ring.rank - step) % ring.size)
        if got is not None:
            outs.append(got[0])
            lses.append(got[1])
        if step < ring.size - 1:
            k, v = ring.shift(k), ring.shift(v)
    weights = torch.stack(lses).softmax(0)
    return (weights * torch.stack(outs)).sum(0) + 0 * (k.sum() + v.sum())


def one_shift_too_many(q, k, v, ring):
    """Right values, but size shifts: the last brings the rank's own K and V back."""
    acc, kv = None, torch.stack((k, v))
    for step in range(ring.size):
        acc = cp.merge(acc, ring.block(q, kv[0], kv[1], (ring.rank - step) % ring.size))
        kv = ring.shift(kv)
    return acc[0] + 0 * kv.sum()


def fewer_shifts_on_rank_0(q, k, v, ring):
    """Rank 0 stops one shift early: the others wait in their last shift for it, a hang in forward."""
    acc, kv = None, torch.stack((k, v))
    for step in range(ring.size):
        acc = cp.merge(acc, ring.block(q, kv[0], kv[1], (ring.rank - step) % ring.size))
        if step < ring.size - 1 - (ring.rank == 0):
            kv = ring.shift(kv)   # the line a hang must name
    return acc[0] + 0 * kv.sum()


def raises_on_rank_1(q, k, v, ring):
    if ring.rank == 1:
        raise ValueError("rank 1 cannot")
    return ex.ring_attention(q, k, v, ring)


def not_written(q, k, v, ring):
    raise NotImplementedError("not_written is not written yet")


def test_the_reference_passes_on_2_and_4_ranks(runs_root, no_leftovers):
    report = ex.check_ring(ex.ring_attention, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["worst_error"] < 1e-5


def test_each_classic_mistake_is_blamed_on_its_step(runs_root, no_leftovers):
    for mistake, check, words in [
            (averaged, "the merge", "right where a rank's queries see one block only"),
            (textbook, "the merge", "exp(lse) of each block, which overflows"),
            (wrong_owner, "block source", "told source = 1, but the K and V you passed are rank 3's"),
            (shift_not_kept, "the shift", "your blocks used the K and V of ranks [0, 0, 0, 0]"),
            (swapped, "ring.block", "the K you passed is rank 0's V"),
            (plus_tie, "output", "plus a constant"),
            (detached_lse, "backward", "your output is right on every rank and probe, but the gradient of")]:
        report = ex.check_ring(mistake, worlds=(4,), runs_root=runs_root)
        assert not report.ok and report.blamed == [mistake.__name__], (mistake.__name__, report.text())
        assert report.findings[1].check == check and words in report.findings[1].message, report.text()
    # a wrong source is not blamed on the shift, a wrong merge not on the blocks
    assert ex.check_ring(wrong_owner, worlds=(4,), runs_root=runs_root).status("the shift") is None
    assert ex.check_ring(averaged, worlds=(4,), runs_root=runs_root).status("block source") is None


def test_the_last_shift_left_out_of_the_graph_is_named_before_it_hangs(runs_root, no_leftovers):
    report = ex.check_ring(untied, worlds=(2,), timeout=20.0, runs_root=runs_root)
    assert report.status("runs") == "pass" and report.status("the shift") == "fail", report.text()
    assert report.blamed == ["untied"] and "does not use what ring.shift returned" in report.text()
    assert "your last ring.block gave None" in report.text() and "backward was not run" in report.text()


def test_correct_alternatives_pass_or_are_told_the_requirement(runs_root, no_leftovers):
    report = ex.check_ring(separate_shifts, runs_root=runs_root)
    assert report.ok, report.text()
    extra = ex.check_ring(one_shift_too_many, worlds=(2,), runs_root=runs_root)
    assert [f.check for f in extra.findings if f.status == "fail"] == ["traffic"], extra.text()
    assert "more than size - 1 = 1 shifts" in extra.text() and extra.blamed == ["one_shift_too_many"]


def test_a_hang_and_a_crash_name_the_learners_line(runs_root, no_leftovers):
    hang = ex.check_ring(fewer_shifts_on_rank_0, worlds=(2,), timeout=3.0, runs_root=runs_root)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "the line a hang" in text)
    assert "made no progress" in hang.text() and hang.blamed == ["fewer_shifts_on_rank_0"], hang.text()
    assert f"test_exercises_ring.py:{line} in fewer_shifts_on_rank_0" in hang.text(), hang.text()
    assert "context.py" not in hang.text() and "probe.py" not in hang.text()
    crash = ex.check_ring(raises_on_rank_1, worlds=(2,), runs_root=runs_root)
    assert "rank 1: your raises_on_rank_1 raised ValueError" in crash.text(), crash.text()
    assert "test_exercises_ring.py" in crash.text() and crash.blamed == ["raises_on_rank_1"]


def test_a_stub_is_reported_as_not_written_yet(runs_root, no_leftovers):
    report = ex.check_ring(not_written, worlds=(2,), runs_root=runs_root)
    assert report.missing and "NOT WRITTEN YET" in report.text()
