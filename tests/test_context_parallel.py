"""Context parallelism's attention (labkit/training/parallel/context.py) on real gloo ranks: ring, all-gather and
Ulysses, contiguous and zigzag splits, at 2 and 4 ranks, each rank's output rows and its q/k/v gradients equal to one
process's attention over the whole sequence; the bytes each rank sent equal to each method's formula; the causal
(query, key) pairs per rank exact; bad splits and head counts refused naming the value."""
from __future__ import annotations

import itertools

import pytest
import torch

import labkit
from labkit.training.parallel import context as cp

B, H, S, D = 2, 4, 16, 8
TOLERANCE = 1e-5   # float32; measured: the largest error over every case below is about 1e-6


def every_method(ctx):
    """On each rank: the full q, k, v and an upstream gradient from one seed, one process's attention as the
    reference, then each method on this rank's positions; the worst errors and what each method sent in forward."""
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(B, H, S, D, generator=gen) for _ in range(4)]   # q, k, v, the output's gradient
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    cp.reference(q, k, v).backward(full[3])
    out = {}
    for method, split in itertools.product(cp.METHODS, cp.SPLITS):
        pos = cp.positions(S, ctx.rank, ctx.world_size, split)
        mine = [t.detach().index_select(2, pos).requires_grad_() for t in full[:3]]
        stats = cp.Traffic()
        got = cp.attention(*mine, pos, method=method, split=split, stats=stats)
        got.backward(full[3].index_select(2, pos))
        expected = cp.reference(*(t.detach() for t in full[:3])).index_select(2, pos)
        grads = [(a.grad - b.grad.index_select(2, pos)).abs().max().item() for a, b in zip(mine, (q, k, v))]
        out[method, split] = {"out": (got - expected).abs().max().item(), "grad": max(grads),
                              "sent": stats.bytes_sent, "pairs": stats.pairs, "skipped": stats.blocks_skipped}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_equals_one_process_and_sends_what_its_formula_says(world, runs_root, no_leftovers):
    run = labkit.launch(every_method, world_size=world, timeout=60, runs_root=runs_root, echo=False)
    block = B * H * (S // world) * D * 4                      # one rank's K (or V) in bytes, float32
    for rank in range(world):
        for (method, split), got in run.result(rank).items():
            assert got["out"] < TOLERANCE and got["grad"] < TOLERANCE, (method, split, rank, got)
            sent = {"ring": 2 * (world - 1) * block,          # forward: K and V passed on at N-1 steps
                    "allgather": 2 * (world - 1) * block,     # forward: K and V to each other rank
                    "ulysses": 4 * (world - 1) * block // world}   # forward: q, k, v there and out back, (N-1)/N each
            assert got["sent"] == sent[method], (method, split, rank, got)
    pairs = {split: cp.causal_pairs(S, world, split) for split in cp.SPLITS}
    assert pairs["zigzag"] == [pairs["zigzag"][0]] * world                   # zigzag: exactly even
    assert pairs["contiguous"] == sorted(set(pairs["contiguous"]))            # contiguous: each rank more than the last
    for rank in range(world):
        for split in cp.SPLITS:
            assert run.result(rank)["ring", split]["pairs"] == B * H * pairs[split][rank]
        assert run.result(rank)["ring", "contiguous"]["skipped"] == world - 1 - rank


def test_the_pairs_per_rank_are_counted_exactly():
    assert cp.causal_pairs(8, 2, "contiguous") == [10, 26] and cp.causal_pairs(8, 2, "zigzag") == [18, 18]
    assert sum(cp.causal_pairs(64, 4, "contiguous")) == 64 * 65 // 2
    assert cp.causal_pairs(64, 4, "contiguous") == [136, 392, 648, 904]   # the last rank: 1.74x its fair 520
    assert cp.causal_pairs(64, 4, "zigzag") == [520] * 4


@pytest.mark.parametrize("args, words", [((15, 0, 2, "zigzag"), "divisible by 4 (2 x ranks, for zigzag)"),
                                         ((15, 0, 2, "contiguous"), "divisible by 2"),
                                         ((16, 0, 2, "striped"), "split = 'striped'")])
def test_bad_splits_are_refused_naming_the_value(args, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        cp.positions(*args)


def uneven_heads(ctx):
    q = torch.zeros(1, 3, 4, 2)
    try:
        cp.attention(q, q, q, cp.positions(8, ctx.rank, 2), method="ulysses")
    except ValueError as error:
        return str(error)


def test_ulysses_refuses_heads_the_degree_does_not_divide(runs_root, no_leftovers):
    run = labkit.launch(uneven_heads, world_size=2, timeout=30, runs_root=runs_root, echo=False)
    assert "divisible by 2; the model has 3 heads" in run.result(0)


@pytest.mark.parametrize("method, split", [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_training_with_context_parallel_2_inside_data_parallel_2_gives_one_process_losses(method, split, runs_root,
                                                                                           no_leftovers):
    base = labkit.RunConfig(world_size=1, global_batch=8, steps=3, seq_len=32, tensorboard=False, save_final=False)
    one = labkit.launch(base, runs_root=runs_root, echo=False)
    four = labkit.launch(base.replace(world_size=4, context_parallel=2, context_method=method, context_split=split),
                         runs_root=runs_root, echo=False)
    gap = abs(one.steps()["loss"].to_numpy() - four.steps()["loss"].to_numpy()).max()
    assert gap < 1e-5, gap                        # float32: measured about 5e-7
    first = four.df[four.df.step == 0].set_index("rank")
    assert first.samples.sum() == 8 and first.tokens.sum() == 8 * 32   # every sample and token counted once
    block = 4 * 4 * 16 * 16 * 4                   # one rank's K: 4 rows x 4 heads x 16 positions x 16 dims, float32
    per_layer = 2 * block if method == "ring" else 4 * block // 2   # ring: K and V once; ulysses: q, k, v, out halves
    assert (first.cp_bytes == 2 * per_layer).all(), first.cp_bytes  # 2 layers
    pairs = cp.causal_pairs(32, 2, split) if method == "ring" else [32 * 33 // 2 // 2] * 2
    assert list(first.cp_pairs) == [4 * 4 * 2 * p for p in pairs] * 2, first.cp_pairs   # rows x heads x layers


@pytest.mark.parametrize("fields, words", [
    (dict(context_parallel=2, context_split="zigzag", seq_len=30), "RunConfig.seq_len = 30"),
    (dict(context_parallel=3), "RunConfig.context_parallel = 3: must divide RunConfig.world_size = 2"),
    (dict(world_size=4, context_parallel=4, model_size="small", context_method="ulysses", global_batch=8,
          layers=2, seq_len=32), None),
    (dict(world_size=8, context_parallel=8, context_method="ulysses", global_batch=8, seq_len=32),
     "RunConfig.context_method = 'ulysses'"),
    (dict(context_parallel=2, task="digits"), "RunConfig.context_parallel = 2: splits GPT-2's sequences"),
    (dict(context_parallel=2, strategy="zero1"), "not with RunConfig.strategy = 'zero1'"),
    (dict(world_size=4, context_parallel=2, strategy="pp", layers=2), "pipeline x context parallelism"),
    (dict(world_size=4, context_parallel=2, strategy="fsdp"), None),
    (dict(context_parallel=2, dropout=0.1), "RunConfig.dropout = 0.1"),
    (dict(context_split="zigzag"), "RunConfig.context_split = 'zigzag': only means something"),
    (dict(world_size=4, context_parallel=2, global_batch=5), "over RunConfig.world_size / context_parallel = 2"),
])
def test_bad_context_parallel_configs_are_refused_naming_the_field(fields, words):
    if words is None:
        labkit.RunConfig(**fields)   # 4 heads over 4 ranks: allowed
        return
    with pytest.raises(labkit.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        labkit.RunConfig(**fields)
