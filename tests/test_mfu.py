"""MFU from a run's records, against a hand calculation: the counts the loop records with each
rank's first step, Run.model(), Run.mfu(peak_flops), labkit.measure.mfu's formula, and runs
without the counts."""

from __future__ import annotations

import json
import math

import pytest

import labkit
from labkit.measure import flops_per_token, matmul_flops, matmul_params, mfu, utilization
from labkit.training.tasks import make_task

from .conftest import copy_without_model_counts

# tinylm "tiny" by hand (transformers' GPT-2: vocab V = 64, positions s = 32, width h = 64,
# 2 blocks; the token embedding is tied to the output layer):
#   wte V·h = 4,096 (the output layer's weight too), wpe s·h = 2,048 (a lookup)
#   a block: ln_1 2h = 128, c_attn h·3h + 3h = 12,480, c_proj h·h + h = 4,160, ln_2 128,
#            c_fc h·4h + 4h = 16,640, mlp c_proj 4h·h + h = 16,448        -> 49,984; two: 99,968
#   ln_f 2h = 128                       total 4,096 + 2,048 + 99,968 + 128 = 106,240
#   N = 106,240 - 2,048 (wpe) = 104,192
#   FLOPs per token = 6N + 12·L·h·s = 625,152 + 12·2·64·32 (49,152) = 674,304
TINYLM = {
    "params": 106_240,
    "params_active": 106_240,
    "params_embedding": 2_048,
    "layers": 2,
    "hidden": 64,
    "seq_len": 32,
}
TINYLM_FLOPS_PER_TOKEN = 674_304
# tinymoe "tiny" by hand (DeepSeek-V3 in transformers: V = 64, h = 32, 2 heads, 2 layers, 8 routed
# experts of intermediate 16, top-2, one shared expert, q_lora 16, kv_lora 8, head dims 8 + 8, v 8):
#   embed_tokens V·h = 2,048 (a lookup: untied), lm_head V·h = 2,048 (a matmul), norm 32
#   attention: q_a 16·32 = 512, q_a_norm 16, q_b 32·16 = 512, kv_a 16·32 = 512, kv_a_norm 8,
#              kv_b 32·8 = 256, o_proj 32·16 = 512                          -> 2,328
#   routed experts 8 x 3·h·16 = 8 x 1,536 = 12,288, router 8·32 = 256, shared 3·16·32 = 1,536,
#   two norms 64                                     a layer 16,472; two: 32,944
#   total 2,048 + 2,048 + 32 + 32,944 = 37,072; idle per token 2 layers x 6 experts x 1,536 = 18,432
#   active 18,640; N = 18,640 - 2,048 = 16,592
#   FLOPs per token = 6·16,592 + 12·2·32·32 = 99,552 + 24,576 = 124,128
TINYMOE = {
    "params": 37_072,
    "params_active": 18_640,
    "params_embedding": 2_048,
    "layers": 2,
    "hidden": 32,
    "seq_len": 32,
}
PEAK = 1e10  # one rank's peak FLOP/s, given (nothing here is timed but the run itself)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = labkit.RunConfig(world_size=2, steps=4, tensorboard=False, save_final=False)
    return labkit.launch(cfg, echo=False, progress=False, runs_root=tmp_path_factory.mktemp("runs"))


def test_the_formula_by_hand():
    assert flops_per_token(104_192, 2, 64, 32) == TINYLM_FLOPS_PER_TOKEN
    assert flops_per_token(matmul_params(TINYMOE), 2, 32, 32) == 124_128
    # a 70B dense model, 4,096 tokens, 80 layers of 8,192: 6·70e9 + 12·80·8192·4096 = 4.522e11
    assert flops_per_token(70e9, 80, 8192, 4096) == pytest.approx(4.2e11 + 32_212_254_720)
    # MFU: 3e17 FLOP/s achieved on 1,024 GPUs of 989 TFLOP/s = 0.2962
    assert utilization(3e17, 989e12, 1024) == pytest.approx(3e17 / 1.012736e18)


def test_the_tasks_count_their_models_as_the_hand_does():
    for task, want in (("tinylm", TINYLM), ("tinymoe", TINYMOE)):
        t = make_task(labkit.RunConfig(task=task, world_size=1))
        assert {k[6:]: v for k, v in t.model_fields(t.build_model()).items()} == want, task


def test_mfu_from_a_real_runs_records_against_a_hand_calculation(run):
    assert run.model() == TINYLM
    # by hand, from the record files: every rank's tokens after the first step, over the slowest
    # rank's total step time for them
    rows = [
        json.loads(line)
        for rank in range(2)
        for line in (run.path / f"rank{rank}.jsonl").read_text().splitlines()
    ]
    later = [r for r in rows if r["step"] > 0]
    tokens = sum(r["tokens"] for r in later)
    assert tokens == 3 * 2 * 16 * 32  # steps 1..3, 2 ranks, 16 samples of 32 tokens each
    seconds = max(sum(r["t_step"] for r in later if r["rank"] == rank) for rank in range(2))
    achieved = TINYLM_FLOPS_PER_TOKEN * tokens / seconds  # 674,304 x 3,072 / seconds
    expected = achieved / (PEAK * 2)  # 2 ranks of 1e10 FLOP/s each
    got = run.mfu(peak_flops=PEAK)
    assert got["flops_per_token"] == TINYLM_FLOPS_PER_TOKEN
    assert got["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-9)
    assert got["achieved_flops_per_s"] == pytest.approx(achieved, rel=1e-9)
    assert got["ranks"] == 2 and got["mfu"] == pytest.approx(expected, rel=1e-9)
    assert "missing" not in got


def test_without_a_peak_the_parts_come_back_and_the_peak_is_said_missing(run):
    got = run.mfu()
    assert got["flops_per_token"] == TINYLM_FLOPS_PER_TOKEN and math.isnan(got["mfu"])
    assert "peak_flops" in got["missing"]
    measured = mfu(run)  # labkit.measure.mfu: the peak measured by a matmul
    assert measured["peak_flops"] > 0 and 0 < measured["mfu"] and "missing" not in measured


def test_a_run_recorded_before_the_counts_still_loads_and_says_what_is_missing(run, tmp_path):
    old = copy_without_model_counts(run.path, tmp_path / "old-run")
    before = labkit.load_run(old)
    assert before.model() == {} and len(before.steps()) == 4
    got = before.mfu(peak_flops=PEAK)
    assert math.isnan(got["mfu"]) and got["tokens_per_s"] == pytest.approx(
        run.mfu()["tokens_per_s"]
    )
    assert "model_params_active" in got["missing"] and "before MFU" in got["missing"]


def test_the_peak_is_the_matmul_tpclaim_measured_before():
    from labkit.tricks import tpclaim

    assert tpclaim.matmul_flops is matmul_flops and matmul_flops(size=64, seconds=0.05) > 0
