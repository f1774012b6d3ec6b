"""Lesson 23's helpers (labkit/tricks/contextpar.py): the chunked ring on real gloo ranks equal to one process with
the hidden chunks skipped, the tables and checks the lesson's claims read (each shown to fail on a planted wrong
value), the splits' picture. The methods themselves are tested in tests/test_context_parallel.py."""
from __future__ import annotations

import types

import pandas as pd
import pytest
import torch

import labkit
from labkit.tricks import contextpar as cpx

S, H, D = 32, 2, 8


def scores_per_split(ctx):
    """Each split and skip: labkit's ring attention's largest error against one process (rows and q/k/v gradients),
    the pairs the mask let this rank see and the scores it computed."""
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(1, H, S, D, generator=gen) for _ in range(4)]
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    cpx.reference(*leaves).backward(full[3])
    out = {}
    for split, skip in (("contiguous", "chunks"), ("zigzag", "chunks"), ("zigzag", "blocks")):
        pos = cpx.positions(S, ctx.rank, ctx.world_size, split)
        mine = [t.index_select(2, pos).requires_grad_() for t in full[:3]]
        stats = cpx.Traffic()
        got = cpx.CODES["chunked" if skip == "chunks" else "whole blocks"](*mine, pos, split=split, stats=stats)
        got.backward(full[3].index_select(2, pos))
        want = cpx.reference(*full[:3]).index_select(2, pos)
        grads = max((a.grad - b.grad.index_select(2, pos)).abs().max().item() for a, b in zip(mine, leaves))
        out[split, skip] = {"error": max((got - want).abs().max().item(), grads), "pairs": stats.pairs,
                            "scores": stats.scores}
    return out


def test_skipping_hidden_chunks_evens_zigzags_work_and_skipping_blocks_does_not(runs_root, no_leftovers):
    run = labkit.launch(scores_per_split, world_size=2, timeout=60, runs_root=runs_root, echo=False)
    got = [run.result(rank) for rank in (0, 1)]
    for rank, mine in enumerate(got):
        for (split, skip), value in mine.items():
            assert value["error"] < 1e-5, (rank, split, skip, value)
            assert value["pairs"] == H * cpx.causal_pairs(S, 2, split)[rank], (rank, split, skip, value)
    chunk = (S // 4) ** 2 * H   # the scores of one (query chunk, key chunk) pair: 4 chunks of 8 positions
    # contiguous: rank 0 (chunks 0, 1) computes (0,0), (1,0), (1,1); rank 1 (chunks 2, 3) those of its own and all
    # four of rank 0's keys: 3 and 7. zigzag, hidden chunk pairs left out: rank 0 (chunks 0, 3) (0,0), (3,0..3),
    # rank 1 (chunks 1, 2) (1,0), (1,1), (2,0..2): 5 each. Whole blocks only: none is hidden whole, 8 each.
    assert [g["contiguous", "chunks"]["scores"] for g in got] == [3 * chunk, 7 * chunk]
    assert [g["zigzag", "chunks"]["scores"] for g in got] == [5 * chunk, 5 * chunk]
    assert [g["zigzag", "blocks"]["scores"] for g in got] == [8 * chunk, 8 * chunk]


def fake_got(world: int, sent_wrong: bool = False, pairs_wrong: bool = False) -> dict:
    """every_method's result as the formulas say it should be (or with one value planted wrong)."""
    block = cpx.BATCH * cpx.HEADS * (cpx.SEQ // world) * (cpx.WIDTH // cpx.HEADS) * 4
    rows = []
    for rank in range(world):
        for method in ("ring", "allgather", "ulysses"):
            for split in ("contiguous", "zigzag"):
                pairs = cpx.BATCH * cpx.HEADS * cpx.LAYERS * cpx.causal_pairs(cpx.SEQ, world, split)[rank]
                rows.append({"rank": rank, "method": method, "split": split, "logits": 1e-7, "grads": 1e-8,
                             "sent": cpx.expected_bytes(method, world, block), "pairs": pairs, "skipped": 0})
    table = pd.DataFrame(rows)
    if sent_wrong:
        table.loc[len(table) - 1, "sent"] += 4
    if pairs_wrong:
        table.loc[(table.method == "ring") & (table["rank"] == world - 1), "pairs"] += 1
    return {"world": world, "seq_len": cpx.SEQ, "block_bytes": block, "rows": table}


def test_the_byte_formulas_by_hand():
    # one rank's K at 4 ranks: 2 x 4 heads x 8 positions x 8 dims x 4 bytes = 2048; 2 layers
    assert cpx.expected_bytes("ring", 4, 2048) == 2 * 2 * 3 * 2048
    assert cpx.expected_bytes("allgather", 4, 2048) == cpx.expected_bytes("ring", 4, 2048)
    assert cpx.expected_bytes("ulysses", 4, 2048) == 2 * 4 * 3 * 2048 // 4
    assert cpx.expected_bytes("ulysses", 2, 2048) == cpx.expected_bytes("ring", 2, 2048)


@pytest.mark.parametrize("world", [2, 4])
def test_the_checks_hold_on_the_formulas_and_fail_on_a_planted_value(world):
    assert cpx.bytes_match(fake_got(world)) and cpx.pairs_match(fake_got(world))
    assert not cpx.bytes_match(fake_got(world, sent_wrong=True))
    assert not cpx.pairs_match(fake_got(world, pairs_wrong=True))
    counted = cpx.pairs_counted(fake_got(world))
    assert len(set(counted["zigzag"])) == 1 and counted["contiguous"] == sorted(counted["contiguous"])
    assert cpx.traffic_table(fake_got(world))["formula"].to_dict() == \
        {m: cpx.expected_bytes(m, world, fake_got(world)["block_bytes"]) for m in ("allgather", "ring", "ulysses")}


def test_the_imbalance_at_4_ranks_is_the_counted_ratio():
    table = cpx.pairs_table(fake_got(4))
    assert table.loc["zigzag", "slowest / fair"] == 1
    assert table.loc["contiguous", "slowest / fair"] == pytest.approx(3648 / 2112)


def timed(seconds: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(value={"seconds": seconds})


def test_the_gated_speed_checks_assert_their_claims():
    fast = timed({"whole blocks/contiguous": 1.0, "whole blocks/zigzag": 1.4, "chunked/contiguous": 1.0,
                  "chunked/zigzag": 0.7})
    assert cpx.zigzag_is_faster(1.2)(fast) == "1.43x" and cpx.zigzag_is_slower_whole(1.1)(fast) == "1.40x"
    slow = timed({"whole blocks/contiguous": 1.0, "whole blocks/zigzag": 1.0, "chunked/contiguous": 1.0,
                  "chunked/zigzag": 0.95})
    with pytest.raises(AssertionError):
        cpx.zigzag_is_faster(1.2)(slow)
    with pytest.raises(AssertionError):
        cpx.zigzag_is_slower_whole(1.1)(slow)


def test_tokens_per_rank_counts_samples_and_positions():
    one = labkit.RunConfig(world_size=1, global_batch=8, seq_len=32)
    four = one.replace(world_size=4, context_parallel=2)
    assert cpx.tokens_per_rank(one) == 256 and cpx.tokens_per_rank(four) == 64


def test_the_picture_titles_give_each_rank_its_pairs():
    import matplotlib
    matplotlib.use("Agg")
    fig = cpx.draw_splits(16, 2)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["contiguous: pairs per rank [36, 100]", "zigzag: pairs per rank [68, 68]"]


def fake_run(config, act_bytes, losses, cp_pairs=None):
    """A Run as the helpers read it: config, df (step, rank, tokens, act_bytes, cp_pairs) and steps()."""
    ranks = range(config.world_size)
    tokens = cpx.tokens_per_rank(config)
    pairs = cp_pairs or [0] * config.world_size
    df = pd.DataFrame([{"step": s, "rank": r, "tokens": tokens, "act_bytes": act_bytes, "cp_pairs": pairs[r]}
                       for s in range(len(losses)) for r in ranks])
    return types.SimpleNamespace(config=config, df=df, steps=lambda: pd.DataFrame({"loss": losses}))


def test_the_activation_table_and_the_loss_gap_read_the_records():
    one = labkit.RunConfig(world_size=1, global_batch=8, seq_len=32)
    four = one.replace(world_size=4, context_parallel=2, context_split="zigzag")
    runs = {"one process": fake_run(one, 4000, [3.0, 2.5]), "DP 2 x CP 2": fake_run(four, 1000, [3.0, 2.5 + 1e-3])}
    table = cpx.act_bytes_per_rank(runs)
    assert table["tokens per rank"].to_dict() == {"one process": 256, "DP 2 x CP 2": 64}
    assert table["bytes per token"].to_dict() == {"one process": 4000 / 256, "DP 2 x CP 2": 1000 / 64}
    assert cpx.loss_gap(runs) == pytest.approx(1e-3)


def test_the_recorded_pairs_are_set_beside_the_causal_count():
    cfg = labkit.RunConfig(world_size=4, context_parallel=2, context_split="contiguous", global_batch=8, seq_len=32)
    layout = cpx.tiny_layout(cfg)
    want = [cfg.batch_per_rank * layout["heads"] * layout["layers"] * p for p in cpx.causal_pairs(32, 2, "contiguous")]
    table = cpx.cp_pairs_table(fake_run(cfg, 1, [1.0], cp_pairs=want * 2))
    assert (table.iloc[:, 0] == table.iloc[:, 1]).all() and table.iloc[0, 1] < table.iloc[1, 1]
    wrong = cpx.cp_pairs_table(fake_run(cfg, 1, [1.0], cp_pairs=want[::-1] * 2))
    assert not (wrong.iloc[:, 0] == wrong.iloc[:, 1]).all()


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_gives_one_process_logits_and_gradients_of_the_tiny_gpt2(world, runs_root, no_leftovers):
    got = cpx.every_method(world=world, runs_root=runs_root)   # every rank, every method, both splits
    assert cpx.worst(got, "logits") < 1e-5 and cpx.worst(got, "grads") < 1e-5, got["rows"]   # measured ~1e-7
    assert cpx.bytes_match(got) and cpx.pairs_match(got), got["rows"]
