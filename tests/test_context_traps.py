"""Context parallelism's traps (labkit/tricks/context_traps.py), each run on real gloo ranks and caught."""
from __future__ import annotations

from labkit.tricks import context_traps as ct


def test_wrong_merges_leave_rank_0_exact_and_every_other_rank_wrong(runs_root, no_leftovers):
    got = ct.wrong_merges(world=4, runs_root=runs_root)
    assert max(got["right"]) < 1e-5
    for mistake in ("averaged", "masked every block"):
        assert got[mistake][0] < 1e-5 and min(got[mistake][1:]) > 0.1, (mistake, got[mistake])


def test_the_textbook_merge_goes_nan_at_large_logits_where_logaddexp_stays_right():
    table = ct.textbook_merge(scales=(1.0, 100.0))
    small, large = table.iloc[0], table.iloc[1]
    assert small.textbook_finite and small.textbook_error < 1e-5
    assert large.max_logit > 88 and not large.textbook_finite and large.logaddexp_error < 1e-4


def test_forgotten_position_ids_barely_move_the_loss_while_the_logits_are_far_off(runs_root, no_leftovers):
    got = ct.forgotten_position_ids(world=2, runs_root=runs_root)
    assert got["with_ids_logits_gap"] < 1e-5
    assert got["logits_gap"] > 0.1 and got["loss_gap"] < 0.05, got
    assert got["logits_rel"] > 10 * got["loss_rel"], got   # each gap against its own scale


def test_gloo_cuts_through_a_head_without_a_word_and_labkit_refuses(runs_root, no_leftovers):
    got = ct.ulysses_uneven_heads(runs_root=runs_root)
    assert not got["gloo_raised"] and got["cut_heads"] == 1 and got["received"] == [[0, 1], [1, 2]]
    assert "needs a head count divisible by 2; the model has 3 heads" in got["refused"]


def test_gloo_refuses_a_transposed_buffer(runs_root, no_leftovers):
    assert "contiguous" in ct.transposed_buffer(runs_root=runs_root)["error"]
