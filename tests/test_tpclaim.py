"""The claim's arithmetic by hand, and what autograd keeps for backward in the tiny GPT-2 (one process)."""
import pytest

from labkit.tricks import parallel, tpclaim


def test_tp_comm_share_by_hand():
    # 4 all-reduces x 2(t-1)/t x 2 bytes / B  against  72·h/t / F:  t=2, h=1000, F=1e12, B=1e10
    comm = 4 * 2 * (1 / 2) * 2 / 1e10
    compute = 72 * 1000 / 2 / 1e12
    assert tpclaim.tp_comm_share(hidden=1000, tp=2, flops_per_s=1e12, bandwidth=1e10) == pytest.approx(comm / compute)
    assert tpclaim.tp_comm_share(hidden=1000, tp=1, flops_per_s=1e12, bandwidth=1e10) == 0.0


def test_what_the_tiny_gpt2_keeps_matches_the_lessons_counts():
    saved = tpclaim.saved_by_module(parallel.lesson_config("ddp", 2, steps=1))
    per_layer = saved[saved["per"] == "layer"]
    whole = per_layer.loc[["transformer.h.*.ln_1", "transformer.h.*.attn.c_attn", "transformer.h.*.ln_2",
                           "transformer.h.*.mlp.c_fc"]].units_of_sbh.round().sum()
    split = per_layer.drop(["transformer.h.*.ln_1", "transformer.h.*.attn.c_attn", "transformer.h.*.ln_2",
                            "transformer.h.*.mlp.c_fc"]).units_of_sbh.round().sum()
    assert (whole, split) == (4, parallel.GPT2_ON_CPU["split_values"])
    assert saved.loc["transformer.h.*.mlp.act", "tensors"] == 4  # GELU written out keeps 4 tensors of width 4h
