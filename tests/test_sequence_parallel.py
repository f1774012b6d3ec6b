"""Sequence parallelism (RunConfig.sequence_parallel) beside tensor parallelism, on real gloo ranks: the
collectives one step issues, counted against the design (Korthikanti et al. 2022: TP's all-reduces become
all-gathers and reduce-scatters, the same bytes on the wire), and the bytes autograd keeps per block against
labkit.memory's formula. That it trains like DDP is checked with every strategy in test_strategies.py."""
import pytest

from labkit import ConfigError, RunConfig
from labkit.tricks import parallel, tpclaim


@pytest.mark.parametrize("changes, words", [
    ({"strategy": "ddp"}, ["strategy must be 'tp' or 'fsdp+tp'", "not 'ddp'"]),
    ({"strategy": "fsdp"}, ["strategy must be 'tp' or 'fsdp+tp'"]),
    ({"strategy": "tp", "seq_len": 33}, ["seq_len = 33", "multiple of 2"]),
    ({"strategy": "tp", "dropout": 0.1}, ["dropout = 0.1", "same random state"]),
    ({"strategy": "tp"}, None),
    ({"strategy": "fsdp+tp", "world_size": 4}, None),
])
def test_sequence_parallel_is_a_tensor_parallel_variant_checked_before_anything_starts(changes, words):
    fields = {"world_size": 2, "sequence_parallel": True, **changes}
    if words is None:
        RunConfig(**fields)
        return
    with pytest.raises(ConfigError) as info:
        RunConfig(**fields)
    assert "RunConfig.sequence_parallel = True" in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_sequence_parallel_swaps_each_all_reduce_for_a_gather_and_a_scatter_and_keeps_less(runs_root,
                                                                                           no_leftovers):
    tp = parallel.megatron_count(2, runs_root=runs_root)
    sp = parallel.megatron_count(2, sequence_parallel=True, runs_root=runs_root)
    blocks, act = tp["blocks"], tp["activation_bytes"]   # act: one block's input, s·b·h fp32 values
    norms = 2 * blocks + 1                                 # LayerNorms: two per block and the final one
    # Megatron: two all-reduces of the block's input size in forward per block, two in backward
    assert tp["forward_kinds"] == tp["backward_kinds"] == {"all_reduce": 2 * blocks}
    assert tp["forward_kind_bytes"] == tp["backward_kind_bytes"] == {"all_reduce": 2 * blocks * act}
    # sequence parallelism: per block an all-gather into each split part and a reduce-scatter out of it, and in
    # backward the reverse; one all-gather more each way where the sequence is joined for the LM head (forward)
    # and for the embeddings' gradient (backward); the LayerNorms' gradients are sums over the sequence's
    # pieces: one all-reduce of h values per weight and bias
    assert sp["forward_kinds"] == {"all_gather": 2 * blocks + 1, "reduce_scatter": 2 * blocks}
    assert sp["backward_kinds"] == {"all_gather": 2 * blocks + 1, "reduce_scatter": 2 * blocks,
                                    "all_reduce": 2 * norms}
    for phase in ("forward", "backward"):
        sent = sp[f"{phase}_kind_bytes"]
        assert sent["all_gather"] == (2 * blocks + 1) * act / 2    # each rank hands its half of the sequence
        assert sent["reduce_scatter"] == 2 * blocks * act            # and the whole partial sum
    assert sp["backward_kind_bytes"]["all_reduce"] == 2 * norms * 64 * 4
    # the same bytes on the wire inside the blocks (all but the gather for the LM head): an all-reduce is a
    # reduce-scatter and an all-gather
    in_blocks = {"all_gather": sp["forward_kind_bytes"]["all_gather"] - act / 2,
                 "reduce_scatter": sp["forward_kind_bytes"]["reduce_scatter"]}
    assert parallel.received_bytes(in_blocks, 2) == parallel.received_bytes(tp["forward_kind_bytes"], 2)

    # bytes autograd kept per block, exactly labkit.memory's formula for this GPT-2 (parallel.activation_form)
    for counted, sequence_parallel in ((tp, False), (sp, True)):
        config = parallel.lesson_config("tp", 2, steps=1, sequence_parallel=sequence_parallel)
        assert counted["saved_per_block"] == tpclaim.predicted_per_block(config)
        # outside the blocks: the formula's final LayerNorm and LM head inputs, plus the embeddings' indices: the
        # token ids (a view of the batch's 33-token sentences, int64) and the 32 positions
        outside = tpclaim.predicted_activations(config) - 2 * tpclaim.predicted_per_block(config)
        assert counted["saved_outside"] - outside == 16 * 33 * 8 + 32 * 8
    # the LayerNorms' inputs and statistics are split: 2 of the 4 whole values per block, the rest stays
    assert tp["saved_per_block"] - sp["saved_per_block"] == 2 * act / 2 + 2 * 2 * 16 * 32 * 4 / 2


def test_the_bytes_each_rank_wrote_to_its_sockets_meet_the_ring_model_for_all_reduces_only(runs_root, no_leftovers):
    """parallel.wire_check: TP's all-reduces write the ring model's bytes (within headers); gloo's reduce-scatter
    writes its whole input, not (N-1)/N of it, so TP+SP writes more than the model says (and more than TP)."""
    tp = parallel.megatron_count(2, runs_root=runs_root)
    sp = parallel.megatron_count(2, sequence_parallel=True, runs_root=runs_root)
    tp_io, sp_io = parallel.wire_check(tp, 2), parallel.wire_check(sp, 2)
    assert parallel.writes_the_ring_model(tp_io) and tp_io["written"] >= tp_io["ring model"], tp_io
    with pytest.raises(AssertionError, match="ring model"):
        parallel.writes_the_ring_model(sp_io)
    assert parallel.writes_over(1.3)((sp_io["written"], tp_io["written"])).endswith("x")
    with pytest.raises(AssertionError, match="not over"):
        parallel.writes_over(1.3)((tp_io["written"], sp_io["written"]))
    gloo = sp["forward_kind_bytes"]["all_gather"] + sp["forward_kind_bytes"]["reduce_scatter"]   # N = 2
    assert abs(sp_io["written"] / gloo - 1) < 0.02, (sp_io, gloo)
    assert parallel.written_bytes() > 0 and parallel.WIRE_UNMEASURED is None   # Linux, where CI runs


def test_without_proc_self_io_the_wire_is_left_unmeasured_not_failed(monkeypatch):
    monkeypatch.setattr(parallel, "WIRE_UNMEASURED", "no /proc/self/io here")
    assert parallel.written_bytes() == 0
