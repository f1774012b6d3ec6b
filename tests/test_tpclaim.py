"""The claim's arithmetic by hand, and what autograd keeps for backward in the tiny GPT-2 (one process); lesson 14's
asserts, each broken on purpose through the labkit function the lesson asserts with (real gloo ranks)."""
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


# --- lesson 14's asserts, each broken on purpose through the labkit function the lesson asserts with -----------
# The lesson's runs (4 steps: the collectives are counted on the first 3), shared by the tests below; each test
# adds the run that breaks its fact. Two of those runs break two facts each, to launch fewer ranks: "ddp w2, sgd,
# 32/step" (no step counters; 16 samples per rank) and "fsdp w2, 8/step, clipped" (a smaller batch; clipping).

@pytest.fixture(scope="module")
def lesson_runs(tmp_path_factory):
    return parallel.run_strategies([("ddp", 2), ("zero1", 2), ("fsdp", 2), ("tp", 2)], steps=4,
                                   runs_root=tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def sgd_run(tmp_path_factory):
    return parallel.run_strategies([("ddp", 2)], steps=4, runs_root=tmp_path_factory.mktemp("runs"),
                                   optimizer="sgd", momentum=0.9, global_batch=32,
                                   name="ddp w2, sgd, 32/step")["ddp w2, sgd, 32/step"]


@pytest.fixture(scope="module")
def fsdp_clipped(tmp_path_factory):
    return parallel.run_strategies([("fsdp", 2)], steps=4, runs_root=tmp_path_factory.mktemp("runs"),
                                   global_batch=8, clip_norm=0.5, name="fsdp w2, 8/step, clipped")


def _excess(run):
    row = parallel.state_table({"r": run}).loc["r"]
    return row.measured - row.formula_with_whole_parts


def test_the_excess_is_4_bytes_per_parameter_tensor_and_not_for_another_optimizer(lesson_runs, sgd_run):
    for label in ("ddp w2", "tp w2"):
        run = lesson_runs[label]
        assert _excess(run) == 4 * parallel.parameter_tensors(run.config)   # 28, and 36 with q, k, v apart
    assert parallel.parameter_tensors(lesson_runs["tp w2"].config) > parallel.parameter_tensors(
        lesson_runs["ddp w2"].config)
    # Broken on purpose: SGD with momentum keeps no step counters (and 4 bytes of state per parameter, not 8).
    assert _excess(sgd_run) != 4 * parallel.parameter_tensors(sgd_run.config)


def test_tp_keeps_more_activations_than_ddp_unless_ddp_ranks_compute_on_more_samples(lesson_runs, sgd_run):
    table = parallel.state_table(lesson_runs)
    assert table.activations["tp w2"] > table.activations["ddp w2"]   # the lesson's assert: 16 samples vs 8
    # Broken on purpose: DDP's ranks on 16 samples each (32 per step) keep more than TP's on the same 16.
    more = parallel.state_table({"ddp 32": sgd_run}).activations["ddp 32"]
    assert not table.activations["tp w2"] > more


def test_ddp_issues_one_all_reduce_and_more_when_its_buckets_are_small(lesson_runs, runs_root, no_leftovers):
    runs = {"ddp w2": lesson_runs["ddp w2"]}
    runs.update(parallel.run_strategies([("ddp", 2)], steps=4, runs_root=runs_root, bucket_cap_mb=0.01,
                                        name="small buckets"))
    calls = parallel.calls_by_run(parallel.collectives_table(runs))
    assert calls["ddp w2"] == {"all_reduce": 1}
    assert calls["small buckets"]["all_reduce"] > 1        # the lesson's "one DDP all-reduce" would fail


def test_zero1_broadcasts_each_parameter_tensor_once(lesson_runs, runs_root, no_leftovers):
    deeper = parallel.run_strategies([("zero1", 2)], steps=4, runs_root=runs_root, layers=3, name="zero1, 3 blocks")
    runs = {"zero1 w2": lesson_runs["zero1 w2"], **deeper}
    calls = parallel.calls_by_run(parallel.collectives_table(runs))
    for label, run in runs.items():
        assert calls[label] == {"all_reduce": 1, "broadcast": parallel.parameter_tensors(run.config)}
    # Broken on purpose: a third block brings 12 more parameter tensors and 12 more broadcasts; the lesson's count
    # (its model's 28 tensors) fails on it.
    tensors = parallel.parameter_tensors(lesson_runs["zero1 w2"].config)
    assert calls["zero1, 3 blocks"]["broadcast"] == tensors + 12
    assert calls["zero1, 3 blocks"] != {"all_reduce": 1, "broadcast": tensors}


def test_the_gradient_norm_is_one_8_byte_all_reduce_and_two_with_clipping(lesson_runs, fsdp_clipped):
    runs = {"fsdp w2": lesson_runs["fsdp w2"], **fsdp_clipped}
    wire = parallel.collectives_table(runs)
    norm = wire[wire.kind == "all_reduce"].set_index("run")
    assert (norm.calls["fsdp w2"], norm.bytes_handed["fsdp w2"]) == (1, 8)   # one float64 sum of squares
    # Broken on purpose: clipping measures the norm again after it clips (labkit records what clipping left):
    # two 8-byte all-reduces, and the lesson's "one" fails.
    assert (norm.calls["fsdp w2, 8/step, clipped"], norm.bytes_handed["fsdp w2, 8/step, clipped"]) == (2, 16)


def test_predicted_parts_meet_the_measured_ones_and_miss_a_run_they_were_not_made_for(lesson_runs, fsdp_clipped):
    runs = {"fsdp w2": lesson_runs["fsdp w2"], **fsdp_clipped}
    small = "fsdp w2, 8/step, clipped"
    measured, predicted = tpclaim.memory_parts(runs), tpclaim.predicted_parts(runs)
    for part in ("model_state", "gathered", "activations", "total"):
        assert (measured[part] / predicted[part] - 1).abs().max() < 0.01, part
    got = tpclaim.describe(measured, "fsdp w2", small)
    want = tpclaim.describe(predicted, "fsdp w2", small)
    assert abs(got["total"] / want["total"] - 1) < 0.01 and got["total"] < 1
    # Broken on purpose: the formula told the wrong batch (16 instead of 8) is far off the measured activations.
    wrong = tpclaim.predicted_parts({small: runs["fsdp w2"]})
    assert abs(measured.loc[small, "total"] / wrong.loc[small, "total"] - 1) > 0.2
