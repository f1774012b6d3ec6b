"""FP8 (training/fp8*.py, tricks/fp8.py): round trips within the bound the formats' mantissa bits set, tile scaling
against an outlier, the simulated GEMM against torch._scaled_mm, the layers switched, training within a stated gap
of fp32 on real gloo ranks, the FP8 dispatch's bytes counted, and bad settings refused naming the field."""
import pytest
import torch
from torch.nn import functional as F

import labkit
from labkit import ConfigError, RunConfig
from labkit.training.fp8 import FORMATS, error_bound, quantise, relative_error
from labkit.training.fp8_layers import FP8Experts, apply_fp8, candidates, to_fp8
from labkit.training.fp8_linear import Recipe, auto_tile, fp8_linear
from labkit.training.fp8_wire import wire_bytes
from labkit.training.tasks import make_task
from labkit.tricks import fp8

TRAINING_GAP = 0.005       # |loss / fp32 loss - 1| over the last 3 of 10 steps, tinylm (seen: below 0.001)
MOE_TRAINING_GAP = 0.01    # tinymoe, expert-parallel with FP8 dispatch (seen: below 0.003): routing flips add noise


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granularity", ["tensor", "tile", "block"])
def test_round_trip_error_stays_within_half_a_step(fmt, granularity):
    """Every element is off by at most 2**-(m+1) of itself (normal numbers) or of the smallest normal times the
    scale (subnormal ones); over a Gaussian tensor the relative error is below that half step too."""
    x = torch.randn(96, 80, generator=torch.Generator().manual_seed(1)) * 5
    q = quantise(x, fmt, granularity, tile=16)
    x_hat = q.dequantise()
    assert x_hat.shape == x.shape
    assert ((x - x_hat).abs() <= error_bound(q, fmt, x) * (1 + 1e-6)).all()
    half_step = 2.0 ** -(FORMATS[fmt].mantissa_bits + 1)
    assert relative_error(x, x_hat) < half_step
    assert q.scale_count() == {"tensor": 1, "tile": 96 * 5, "block": 6 * 5}[granularity]


def test_formats_read_from_their_bit_patterns_agree_with_torch():
    table = fp8.formats_table()
    for name in ("e4m3", "e5m2"):
        row = table.loc[name]
        assert row.measured_max == row["max"] == {"e4m3": 448.0, "e5m2": 57344.0}[name]
        assert row.measured_smallest == row.smallest_subnormal and row.measured_step_after_1 == row.step_after_1
        assert row.rounding_error == 2.0 ** -(row.mantissa_bits + 1)


def test_tile_scaling_beats_per_tensor_with_an_outlier():
    case = fp8.outlier_case()   # 1e5 at [0, 0] of 256 x 256, tiles 1 x 128, blocks 128 x 128
    assert case.loc["tile", "activation_error"] < case.loc["tensor", "activation_error"] / 3
    assert case.loc["tile", "matmul_error"] < case.loc["tensor", "matmul_error"] / 2
    assert case.loc["tensor", "flushed_to_zero"] > 0.1 and case.loc["tile", "flushed_to_zero"] == 0


def test_simulated_gemm_computes_what_torch_scaled_mm_computes():
    assert max(fp8.scaled_mm_check().values()) < 1e-6   # 0.0 measured with torch 2.13 on CPU


def test_fp8_linear_forward_and_backward_are_close_and_tile_one_is_exact():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).requires_grad_(True) for s in ((24, 32), (16, 32), (16,)))
    grads = {}
    for name, recipe in (("fp32", None), ("tile", Recipe("tile", 8)), ("exact", Recipe("tile", 1))):
        y = F.linear(x, w, b) if recipe is None else fp8_linear(x, w, b, recipe)
        y.square().sum().backward()
        grads[name] = (y.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = b.grad = None
    for ref, got in zip(grads["fp32"], grads["tile"]):
        assert 0 < relative_error(ref, got) < 0.08   # a few E4M3 roundings in a row
    for ref, got in zip(grads["fp32"], grads["exact"]):
        assert relative_error(ref, got) < 1e-6       # one scale per value: every value lands on 448 exactly


def test_the_layers_switched_and_kept():
    lm = make_task(RunConfig(), 1).build_model()
    keys = list(lm.state_dict())
    names = apply_fp8(lm, RunConfig(precision="fp8"))["layers"]
    assert len(names) == 8 and all(type(lm.get_submodule(n)).__name__ == "FP8Conv1D" for n in names)
    assert type(lm.lm_head).__name__ == "Linear" and list(lm.state_dict()) == keys
    moe = make_task(RunConfig(task="tinymoe"), 1).build_model()
    kinds = [type(m).__name__ for m in candidates(moe).values()]
    assert kinds.count("DeepseekV3Experts") == 2 and kinds.count("Linear") == 16 and "lm_head" not in candidates(moe)
    assert auto_tile(64) == 16 and auto_tile(32) == 8


def test_fp8_experts_at_tile_one_equal_transformers_experts():
    """The routed experts' own loop (F.linear on slices of the fused 3-D parameters) is checked apart from rounding:
    at tile 1 every value has its own scale and FP8 is exact, so the output equals transformers' grouped_mm."""
    moe = make_task(RunConfig(task="tinymoe"), 1).build_model()
    experts = moe.model.layers[0].mlp.experts
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1), torch.nn.init.normal_(experts.down_proj, std=0.1)
    g = torch.Generator().manual_seed(0)
    hidden, index = torch.randn(40, 32, generator=g), torch.randint(8, (40, 2), generator=g)
    weights = torch.rand(40, 2, generator=g)
    reference = experts(hidden, index, weights)
    to_fp8(moe, Recipe("tile", 1))
    assert isinstance(experts, FP8Experts)
    assert relative_error(reference, experts(hidden, index, weights)) < 1e-6
    experts.fp8_recipe = Recipe("tile", 8)
    assert 0 < relative_error(reference, experts(hidden, index, weights)) < 0.08


@pytest.mark.parametrize("changes, field", [
    ({"precision": "fp8", "task": "digits"}, "precision"),
    ({"precision": "fp8", "strategy": "fsdp"}, "precision"),
    ({"precision": "fp8", "fp8_scaling": "block"}, "fp8_scaling"),
    ({"precision": "fp8", "fp8_scaling": "row", "fp8_tile": 16}, "fp8_tile"),
    ({"precision": "fp8", "fp8_engine": "transformer-engine"}, "fp8_engine"),
    ({"precision": "fp8", "fp8_engine": "torchao"}, "fp8_engine"),               # tinylm: GPT-2 has no nn.Linear
    ({"precision": "fp8", "fp8_engine": "torchao", "task": "tinymoe"}, "fp8_engine"),   # scaling "tile": a GPU's
    ({"fp8_engine": "torchao"}, "fp8_engine"),
    ({"precision": "fp8", "fp8_tile": -1}, "fp8_tile"),
    ({"precision": "fp8", "fp8_grad_format": "e3m4"}, "fp8_grad_format"),
    ({"fp8_scaling": "tensor"}, "fp8_scaling"),
    ({"fp8_tile": 16}, "fp8_tile"),
    ({"fp8_dispatch": True, "task": "tinymoe"}, "fp8_dispatch"),
    ({"fp8_dispatch": True}, "fp8_dispatch"),
    ({"fp8_dispatch": 1}, "fp8_dispatch"),
])
def test_bad_fp8_settings_are_refused_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"RunConfig.{field} = "):
        RunConfig(**changes)


def test_fp8_dispatch_carries_a_quarter_of_the_bytes_plus_scales(runs_root):
    """2 ranks, 4 experts each: the same layer forward and backward with the dispatch in fp32 and in FP8; the
    all_to_all bytes counted at the dispatcher differ by exactly the dispatch's fp32 bytes minus FP8's."""
    got = fp8.dispatch_check(runs_root=runs_root)
    rows, width, tile = got["rows_out"], got["width"], got["tile"]
    (n32, bytes32), (n8, bytes8) = got["fp32"]["bytes"], got["fp8"]["bytes"]
    assert n8 == n32 + 1                                          # the scales travel in a call of their own
    assert bytes32 - bytes8 == rows * width * 4 - wire_bytes(rows, width, tile)
    assert wire_bytes(rows, width, tile) == rows * width * (1 + 4 / tile)
    assert got["output_error"] < FORMATS["e4m3"].relative_error and got["grad_error"] < FORMATS["e4m3"].relative_error
    assert 0 < got["dispatch_vs_bound"] <= 1     # the rows the experts got (ExpertParallel.on_arrival): rounded, in bound


def test_fp8_training_stays_within_the_stated_gap_of_fp32(runs_root):
    common = dict(steps=10, tensorboard=False, save_final=False)
    lm = RunConfig(world_size=2, global_batch=32, **common)
    moe = RunConfig(task="tinymoe", world_size=2, expert_parallel=2, global_batch=16, lr=1e-2, **common)
    runs = {name: labkit.launch(cfg, echo=False, progress=False, runs_root=runs_root) for name, cfg in {
        "lm fp32": lm, "lm fp8": lm.replace(precision="fp8"),
        "moe fp32": moe, "moe fp8": moe.replace(precision="fp8", fp8_dispatch=True)}.items()}
    final = {name: run.steps()["loss"].iloc[-3:].mean() for name, run in runs.items()}
    assert abs(final["lm fp8"] / final["lm fp32"] - 1) < TRAINING_GAP, final
    assert abs(final["moe fp8"] / final["moe fp32"] - 1) < MOE_TRAINING_GAP, final
    assert final["lm fp8"] < runs["lm fp8"].steps()["loss"].iloc[0]   # and it trains
    wire = fp8.wire_traffic(runs["moe fp8"])
    assert (wire.bytes_all_to_all == wire.formula).all(), wire[["bytes_all_to_all", "formula"]]


def test_the_tiny_models_gradients_favour_e5m2_per_tensor_and_e4m3_per_tile():
    """What lesson 20 says about the formats, on the tiny GPT-2's own gradients (seeded: the run's initial weights)."""
    grad = fp8.model_tensors(RunConfig()).loc["gradient"]
    assert grad.flushed_to_zero[("e4m3", "tensor")] > 2 * grad.flushed_to_zero[("e5m2", "tensor")]
    assert grad.mean_error.idxmin() == ("e4m3", "tile")
