"""labkit.memory: the ZeRO paper's formulas, checked against values worked out by hand."""
import pytest

import labkit
from labkit import memory
from labkit.memory import model_state_bytes, state_breakdown

GB = 1e9


def test_the_papers_worked_example():
    # ZeRO paper, figure 1: a 7.5B-parameter model on 64 data-parallel GPUs, mixed-precision Adam (K = 12).
    assert model_state_bytes(7.5e9, stage=0, dp=64) / GB == pytest.approx(120.0)
    assert model_state_bytes(7.5e9, stage=1, dp=64) / GB == pytest.approx(31.40625)   # 30 + 90/64
    assert model_state_bytes(7.5e9, stage=2, dp=64) / GB == pytest.approx(16.640625)  # 15 + 105/64
    assert model_state_bytes(7.5e9, stage=3, dp=64) / GB == pytest.approx(1.875)      # 120/64


def test_small_cases_by_hand():
    # 1000 parameters, 2 ranks: stage 1 = 2000 + 2000 + 12000/2 = 10000 bytes
    assert model_state_bytes(1000, stage=1, dp=2) == 10_000
    # stage 2 = 2000 + (2000 + 12000)/2 = 9000; stage 3 = 16000/2 = 8000
    assert model_state_bytes(1000, stage=2, dp=2) == 9_000
    assert model_state_bytes(1000, stage=3, dp=2) == 8_000
    # tensor parallelism halves the model first: stage 3, dp 2, tp 2 -> 16000/2/2
    assert model_state_bytes(1000, stage=3, dp=2, tp=2) == 4_000
    # one rank: every stage is the baseline
    assert {model_state_bytes(1000, stage=s, dp=1) for s in range(4)} == {16_000}


def test_fp32_adam_on_cpu_by_part():
    parts = state_breakdown(1000, stage=1, dp=4, param_bytes=4, grad_bytes=4, k=8)
    assert (parts.params, parts.grads, parts.optimizer, parts.total) == (4000, 4000, 2000, 10_000)


def test_reachable_as_labkit_memory():
    assert labkit.memory.model_state_bytes(1000, stage=0, dp=8) == 16_000


@pytest.mark.parametrize("kwargs, message", [({"stage": 4, "dp": 2}, "stage"), ({"stage": 1, "dp": 0}, "dp"),
                                             ({"stage": 1, "dp": 2, "tp": 1.5}, "tp"),
                                             ({"stage": 1, "dp": 2, "k": -1}, "k")])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        model_state_bytes(1000, **kwargs)


# --- activations: Korthikanti et al. 2022, section 4 ---------------------------------------------------------------

def test_activations_of_the_papers_layer_by_hand():
    # s=2048, b=1, h=12288, a=96: s·b·h·34 + 5·a·s²·b bytes
    s, b, h, a = 2048, 1, 12288, 96
    assert memory.activation_bytes(seq=s, batch=b, hidden=h, heads=a) == 34 * s * b * h + 5 * a * s * s * b
    # with tensor parallelism over 8: s·b·h·(10 + 24/8 + 5·a·s/(h·8))
    assert memory.activation_bytes(seq=s, batch=b, hidden=h, heads=a, tp=8) == pytest.approx(
        s * b * h * (10 + 3 + 5 * a * s / (h * 8)))


def test_activations_of_a_small_case_by_hand():
    # s=4, b=2, h=8, a=2, fp32, no dropout, fused attention, 1 layer: sbh = 64 values
    # whole 4·64·4 = 1024, split 12·64·4/2 = 1536, log-sum-exp 2·4·2·4/2 = 32  -> 2592 bytes
    got = memory.activation_bytes(seq=4, batch=2, hidden=8, heads=2, tp=2, value_bytes=4, dropout=False, scores=False)
    assert got == 2592
    # two layers, the final LayerNorm's and LM head's inputs (2·64·4 = 512) and LayerNorm statistics
    # (per layer 2 LayerNorms x 2 values x 8 positions x 4 B = 128; final 64)
    assert memory.activation_bytes(seq=4, batch=2, hidden=8, heads=2, layers=2, tp=2, value_bytes=4, dropout=False,
                                   scores=False, outside_values=2, norm_stats=True) == 2 * (2592 + 128) + 512 + 64


@pytest.mark.parametrize("kwargs, message", [({"heads": 3}, "heads"), ({"tp": 3}, "tp"), ({"layers": 0}, "layers")])
def test_activation_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        memory.activation_bytes(**{"seq": 8, "batch": 1, "hidden": 8, "heads": 2, **kwargs})


def test_sequence_parallel_activations_of_the_papers_layer_by_hand():
    # Korthikanti et al., section 4.2.2: with sequence parallelism every term is split, s·b·h·(34/t + 5·a·s/(h·t))
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    got = memory.activation_bytes(seq=s, batch=b, hidden=h, heads=a, tp=t, sequence_parallel=True)
    assert got == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))
    # it saves s·b·h·(10 - 10/t) bytes per layer over tensor parallelism alone: the whole values and the masks
    alone = memory.activation_bytes(seq=s, batch=b, hidden=h, heads=a, tp=t)
    assert alone - got == pytest.approx(s * b * h * 10 * (1 - 1 / t))
    # on one rank there is nothing to split: the same as no parallelism
    assert memory.activation_bytes(seq=s, batch=b, hidden=h, heads=a, tp=1, sequence_parallel=True) == \
        memory.activation_bytes(seq=s, batch=b, hidden=h, heads=a)


def test_sequence_parallel_activations_of_a_small_case_by_hand():
    # s=4, b=2, h=8, a=2, tp=2, fp32, no dropout, fused attention, 1 layer, sbh = 64 values of 4 B = 256 B:
    # 2 gathered values kept whole (512), the other 2 whole ones split (256), 12 split (1536), log-sum-exp 32,
    # LayerNorm statistics split (2 x 2 x 8 x 4 / 2 = 64); outside: 1 gathered (256), 1 split (128), final
    # statistics split (2 x 8 x 4 / 2 = 32)
    kwargs = dict(seq=4, batch=2, hidden=8, heads=2, tp=2, value_bytes=4, dropout=False, scores=False,
                  outside_values=2, norm_stats=True, sequence_parallel=True)
    assert memory.activation_bytes(**kwargs, gathered_values=2, outside_gathered_values=1) == \
        512 + 256 + 1536 + 32 + 64 + 256 + 128 + 32
    # gathered values mean nothing without sequence parallelism: tensor parallelism keeps the whole values whole
    assert memory.activation_bytes(**{**kwargs, "sequence_parallel": False}, gathered_values=2) == \
        memory.activation_bytes(**{**kwargs, "sequence_parallel": False})
    with pytest.raises(ValueError, match="gathered_values"):
        memory.activation_bytes(**kwargs, gathered_values=5)
