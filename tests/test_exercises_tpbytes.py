"""Lesson 27's numbers-first exercise: TP's all-reduce bytes per block and the activations kept
per block, with and without recomputation. The reference passes on a GPT-3 layer and on 2 gloo
ranks; each usual slip is named; a toy-only mistake is named against what the ranks measured; the
stub is "not written yet"."""

from __future__ import annotations

import pytest

from labkit.exercises import checks_tpbytes as tb
from labkit.exercises.checks_tpbytes import (
    TP_BYTES_REFERENCE,
    check_tp_bytes,
    kept_per_layer,
    tp_allreduce_bytes,
)
from labkit.exercises.report import Report


def test_the_reference_passes_on_a_gpt3_layer_and_on_real_ranks(runs_root, no_leftovers):
    report = check_tp_bytes(tp_allreduce_bytes, kept_per_layer, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) == TP_BYTES_REFERENCE
    toy = report.measured["toy"]["rank 0"]
    assert toy["none"]["kinds"] == {"all_reduce": 4 * toy["none"]["blocks"]}
    assert toy["full"]["kept"] < toy["none"]["kept"] / 10


def _sent(s, b, h, t, *, value_bytes=2, ring=True, phases=2, two=True, per_rank=True, split=False):
    factor = (2 if two else 1) * (t - 1) / t if ring else (2 if two else 1)
    total = 2 * phases * factor * s * b * h * value_bytes / (t if split else 1)
    return total if per_rank else total * t


def _slip(**change):
    return lambda s, b, h, t, value_bytes=2: _sent(
        s, b, h, t, **{"value_bytes": value_bytes, **change}
    )


SENT_SLIPS = {
    "forward_only": (_slip(phases=1), "forward only"),
    "values": (_slip(value_bytes=1), "values, not bytes"),
    "no_ring": (_slip(ring=False, two=False), "2(t-1)/t forgotten"),
    "n_for_n_minus_1": (_slip(ring=False), "N for N - 1"),
    "reduce_scatter": (_slip(two=False), "a reduce-scatter's bytes"),
    "split": (_slip(split=True), "divided by t"),
    "all_ranks": (_slip(per_rank=False), "ONE rank"),
}


@pytest.mark.parametrize("slip", sorted(SENT_SLIPS))
def test_each_usual_slip_in_the_all_reduce_bytes_is_named(slip):
    fn, words = SENT_SLIPS[slip]
    report = Report("x")
    g = tb.GPT3
    got = [fn(g["seq"], g["batch"], g["hidden"], t, value_bytes=vb) for t, vb in tb.SENT_POINTS]
    assert not tb.judge_sent(report, got, "tp_allreduce_bytes")
    assert report.blamed == ["tp_allreduce_bytes"] and words in report.text(), report.text()


def _kept(
    s,
    b,
    h,
    a,
    t,
    *,
    recompute=False,
    value_bytes=2,
    whole=4,
    split=12,
    masks=2,
    score_bytes=5,
    divide=True,
    scores_split=True,
    sp=False,
    rec=None,
):
    sbh = s * b * h
    if recompute:
        return sbh * value_bytes if rec is None else rec(sbh, value_bytes, t)
    t_split = t if divide else 1
    whole_t = t if sp else 1
    return sbh * (
        (whole / whole_t + split / t_split) * value_bytes + masks / whole_t
    ) + a * s * s * b * score_bytes / (t_split if scores_split else 1)


KEPT_SLIPS = {
    "tp_not_divided": (dict(divide=False), "tensor parallelism not divided"),
    "scores_not_split": (dict(scores_split=False), "scores not divided by t"),
    "sequence_parallel": (dict(sp=True), "that is sequence parallelism"),
    "values": (dict(value_bytes=1), "values, not bytes"),
    "no_masks": (dict(masks=0), "dropout masks forgotten"),
    "no_scores": (dict(score_bytes=0), "attention scores forgotten"),
    "keeps_nothing": (dict(rec=lambda sbh, vb, t: 0), "keeps nothing"),
    "ignored": (dict(rec=lambda sbh, vb, t: None), "recomputation ignored"),
    "input_split": (dict(rec=lambda sbh, vb, t: sbh * vb / t), "input split over t"),
}


@pytest.mark.parametrize("slip", sorted(KEPT_SLIPS))
def test_each_usual_slip_in_the_activation_bytes_is_named(slip):
    change, words = KEPT_SLIPS[slip]
    g = tb.GPT3

    def fn(t, r):
        if slip == "ignored":
            return _kept(g["seq"], g["batch"], g["hidden"], g["heads"], t)
        return _kept(g["seq"], g["batch"], g["hidden"], g["heads"], t, recompute=r, **change)

    report = Report("x")
    got = [fn(t, r) for t in tb.TPS for r in (False, True)]
    assert not tb.judge_kept(report, got, "kept_per_layer")
    assert report.blamed == ["kept_per_layer"] and words in report.text(), report.text()


def recompute_in_two_bytes(
    seq,
    batch,
    hidden,
    heads,
    tp,
    *,
    recompute=False,
    value_bytes=2,
    whole=4,
    split=12,
    masks=2,
    score_bytes=5,
):
    """Right on GPT-3's 2-byte layer; on the fp32 toy, 2·s·b·h taken literally when recomputed."""
    if recompute:
        return 2 * seq * batch * hidden
    return kept_per_layer(
        seq,
        batch,
        hidden,
        heads,
        tp,
        value_bytes=value_bytes,
        whole=whole,
        split=split,
        masks=masks,
        score_bytes=score_bytes,
    )


def fp16_wire(seq, batch, hidden, tp, *, value_bytes=2):
    """Right on GPT-3's layer; value_bytes ignored on the fp32 toy."""
    return tp_allreduce_bytes(seq, batch, hidden, tp)


def test_mistakes_only_the_toy_shows_are_named_against_what_the_ranks_measured(
    runs_root, no_leftovers
):
    report = check_tp_bytes(fp16_wire, recompute_in_two_bytes, runs_root=runs_root)
    text = report.text()
    assert not report.ok and report.blamed == ["fp16_wire", "recompute_in_two_bytes"], text
    assert "value_bytes ignored" in text and "with recomputation: your 65,536" in text, text


def not_written(seq, batch, hidden, tp, *, value_bytes=2):
    raise NotImplementedError("tp_allreduce_bytes is not written yet")


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(
    runs_root, no_leftovers, monkeypatch
):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    report = check_tp_bytes(not_written, kept_per_layer, runs_root=runs_root)
    assert not report.ok and not report.failures and "not written yet" in report.text(), (
        report.text()
    )
    assert report.use(TP_BYTES_REFERENCE) == TP_BYTES_REFERENCE
