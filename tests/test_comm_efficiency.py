"""Lesson 04's machinery (labkit.tricks.commeff, labkit.tricks.precision) and what the lesson asserts that
tests/test_commhooks.py does not: accumulation arithmetic and bytes, what autocast changes (activations) and does
not (gradients on the wire), GradScaler's skip-and-halve on CPU, PowerSGD's predicted payload, torch's bf16 hook
refusing gloo, the bucket experiment, and the tables and figures the lesson draws from runs."""
import functools
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

import labkit
from labkit import RunConfig
from labkit.records import slowest_per_step
from labkit.training.tasks import make_task
from labkit.tricks import commeff, commeff_claims, precision


@pytest.mark.parametrize("accum", [1, 2, 4, 8])
def test_accumulation_splits_the_same_global_batch_into_micro_batches(accum):
    cfg = RunConfig.per_rank(batch_per_rank=16 // accum, world_size=2, grad_accum=accum)
    assert cfg.global_batch == 32 == cfg.world_size * cfg.batch_per_rank * cfg.grad_accum
    task, whole = make_task(cfg), make_task(cfg.replace(world_size=1, grad_accum=1))
    # Every (micro-batch, rank) slice, in order, rebuilds exactly the batch one rank would take in one go.
    parts = torch.cat([task.batch(5, micro, rank)[0] for micro in range(accum) for rank in range(2)])
    assert torch.equal(parts, whole.batch(5, 0, 0)[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    base = RunConfig(world_size=2, global_batch=16, steps=2, tensorboard=False, save_final=False)
    configs = {"naive x2": base.replace(grad_accum=2, no_sync=False), "no_sync x2": base.replace(grad_accum=2),
               "fp32": base, "bf16": base.replace(precision="bf16")}
    return {name: labkit.launch(cfg, runs_root=root, echo=False, progress=False) for name, cfg in configs.items()}


def fp32_gradient_bytes():
    return 4 * sum(p.numel() for p in make_task(RunConfig(world_size=2)).build_model().parameters())


def test_naive_accumulation_sends_accum_times_the_bytes_for_the_same_global_batch(runs):
    grad = fp32_gradient_bytes()
    assert runs["naive x2"].df["comm_bytes"].tolist() == [2 * grad] * 4  # 2 steps x 2 ranks
    assert runs["no_sync x2"].df["comm_bytes"].tolist() == [grad] * 4
    for name in ("naive x2", "no_sync x2"):
        assert runs[name].df.groupby("step")["samples"].sum().tolist() == [16, 16]


def test_accumulating_with_no_sync_is_the_same_update_as_one_big_batch(runs):
    assert runs["no_sync x2"].steps()["loss"].tolist() == pytest.approx(runs["fp32"].steps()["loss"].tolist(), abs=1e-5)


def test_powersgd_payload_is_the_low_rank_factors_of_large_matrices_only():
    shapes = [torch.Size([100, 50]), torch.Size([50]), torch.Size([4, 4])]
    # 100x50 at rank 2: P 100x2 + Q 50x2 = 300 elements; the bias whole; 4x4 would not halve at rank 2: whole
    assert commeff.powersgd_payload(shapes, rank=2) == (300 + 50 + 16) * 4
    tiny = commeff.gradient_shapes(RunConfig(world_size=2))
    one, four = commeff.powersgd_payload(tiny, 1), commeff.powersgd_payload(tiny, 4)
    assert one < fp32_gradient_bytes() / 20 and one < four < fp32_gradient_bytes() / 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is a CPU/gloo fact")
def test_torchs_bf16_compress_hook_refuses_gloo_on_cpu(runs_root):
    outcome = labkit.launch(commeff.try_torch_bf16_hook, world_size=1, runs_root=runs_root, echo=False,
                            progress=False).result(0)
    assert outcome != "registered and ran" and "NCCL" in outcome


def test_autocast_keeps_gradients_fp32_so_the_wire_bytes_do_not_change(runs):
    assert runs["bf16"].df["comm_bytes"].tolist() == runs["fp32"].df["comm_bytes"].tolist() == [fp32_gradient_bytes()] * 4
    assert runs["bf16"].steps()["loss"].tolist() == pytest.approx(runs["fp32"].steps()["loss"].tolist(), abs=0.02)


def test_autocast_halves_a_layers_output_and_shrinks_what_backward_keeps():
    facts = precision.autocast_facts(RunConfig(world_size=2), batch_size=8)
    assert facts.loc["fp32", "first MLP layer output"].startswith("float32")
    assert facts.loc["bf16", "first MLP layer output"].startswith("bfloat16")
    assert facts.loc["fp16", "first MLP layer output"].startswith("float16")
    assert facts.loc["bf16", "its bytes"] * 2 == facts.loc["fp32", "its bytes"]
    assert 0.4 < facts.loc["bf16", "saved for backward (MiB)"] / facts.loc["fp32", "saved for backward (MiB)"] < 0.75
    assert (facts["gradient dtype"] == "float32").all()
    small = precision.autocast_facts(RunConfig(world_size=2), batch_size=2, precisions=("fp32",))
    assert small.loc["fp32", "saved for backward (MiB)"] < facts.loc["fp32", "saved for backward (MiB)"] / 2


def scaled_fp16_step(init_scale, growth_interval=2000):
    """One fp16 autocast step of a tiny linear model through a CPU GradScaler: (weights changed, scale after)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(2, 8)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return changed, scaler.get_scale()


def test_grad_scaler_on_cpu_skips_an_overflowing_step_and_halves_the_scale():
    changed, scale = scaled_fp16_step(2.0**30)  # 2**30 x a gradient of 1 does not fit fp16 (max 65504): inf
    assert not changed and scale == 2.0**29


def test_grad_scaler_on_cpu_steps_when_finite_and_grows_after_growth_interval():
    changed, scale = scaled_fp16_step(2.0, growth_interval=1)
    assert changed and scale == 4.0


def test_the_lessons_tables_and_figures_come_from_the_runs(runs):
    table = commeff.accumulation_table({(2, "naive"): runs["naive x2"], (2, "no_sync"): runs["no_sync x2"]}, warm=0)
    assert table["all-reduces per step"].tolist() == [2, 1] and table["samples per step"].tolist() == [16, 16]
    assert table.loc[(2, "naive"), "KiB per step"] == 2 * table.loc[(2, "no_sync"), "KiB per step"]
    payloads = commeff.payload_table({"fp32": runs["fp32"]}, fp32_gradient_bytes(), warm=0)
    assert payloads.loc["fp32", "vs fp32"] == 1.0 and payloads.loc["fp32", "collectives per step"] == 1
    amp = precision.run_table({"fp32": runs["fp32"], "bf16": runs["bf16"]}, warm=0)
    assert amp["skipped steps"].tolist() == [0, 0] and amp["last loss scale"].tolist() == [1.0, 1.0]
    assert isinstance(commeff.plot_accumulation(table), Figure)
    assert isinstance(commeff.plot_payloads({"fp32": runs["fp32"]}, warm=0), Figure)


def test_steps_refuses_runs_whose_ranks_disagree_on_what_they_sent(runs):
    run = runs["fp32"]
    run.df.loc[0, "comm_bytes"] += 1           # as if one rank had sent a byte more (a cached copy, not the file)
    try:
        with pytest.raises(ValueError, match="comm_bytes"):
            commeff.steps(run)
    finally:
        run.df.loc[0, "comm_bytes"] -= 1


def test_bucket_timing_counts_fewer_all_reduces_for_bigger_buckets(runs_root, no_leftovers):
    cfg = RunConfig(world_size=2, global_batch=16, lr=3e-3, tensorboard=False)
    run = labkit.launch(functools.partial(commeff.bucket_timing, caps=(0.01, 25.0), steps=3), config=cfg,
                        runs_root=runs_root, echo=False, progress=False)
    table = commeff.bucket_table({"tiny": run}, warm=1)
    counts = table.loc["tiny", "allreduces"].tolist()
    assert counts[0] > counts[1] == 1 and table.loc[("tiny", 25.0), "tensors"] == len(commeff.gradient_shapes(cfg))
    assert 0 <= table.loc[("tiny", 0.01), "first_launch"] < table.loc[("tiny", 25.0), "first_launch"] <= 1
    assert isinstance(commeff.plot_buckets(table), Figure)


def test_wire_table_scales_measured_bytes_per_element():
    assert commeff.wire_gb(7000, 2.0) == 14.0 and commeff.wire_gb(1000, 4.0, grad_accum=8, no_sync=False) == 32.0
    table = commeff.wire_table({"fp16": 2.0}, params_millions=(1000,), grad_accum=4)
    assert table.iloc[0]["naive x4 (GB/step)"] == 4 * table.iloc[0]["no_sync x4 (GB/step)"] == 8.0


def test_autocast_speed_and_cpu_flags_are_measured_here():
    speed = precision.autocast_speed(RunConfig(world_size=2), batch_size=4, repeats=2)
    assert list(speed.index) == ["fp32", "bf16", "fp16"] and speed.loc["fp32", "model vs fp32"] == 1.0
    assert (speed.iloc[:, 1] > 0).all() and set(precision.cpu_16bit_flags()) <= precision.FLAGS_16BIT
    history = pd.DataFrame({"scale": [4.0, 2.0, 2.0], "weights changed": [False, True, True]})
    assert isinstance(precision.plot_loss_scale(history), Figure)


# --- the lesson's one-line claims (commeff_claims, precision): each holds on what it should and fails otherwise ---

def fake_run(allreduces, comm_bytes, loss=None):
    """A Run-like object with two ranks that recorded the same counts per step (what commeff.steps reads)."""
    n = len(allreduces)
    loss = loss or [3.0 - 0.1 * i for i in range(n)]
    rows = [{"rank": r, "step": i, "t_step": 0.01, "t_fwd_bwd": 0.005, "allreduces": allreduces[i],
             "comm_bytes": comm_bytes[i], "samples": 8, "loss": loss[i], "grad_norm": 1.0, "loss_scale": 1.0,
             "skipped_step": 0} for i in range(n) for r in range(2)]
    df = pd.DataFrame(rows)
    return SimpleNamespace(name="fake", df=df, slowest=lambda *columns, after=0: slowest_per_step(df, columns, after))


def test_the_accumulation_claims_read_the_runs(runs):
    grad = fp32_gradient_bytes()
    accum = {(2, "naive"): runs["naive x2"], (2, "no_sync"): runs["no_sync x2"]}
    swapped = {(2, "naive"): runs["no_sync x2"], (2, "no_sync"): runs["naive x2"]}
    for claim in (commeff_claims.naive_allreduces_once_per_micro_batch, commeff_claims.no_sync_allreduces_once):
        assert claim(accum)[0] and not claim(swapped)[0]
    assert commeff_claims.bytes_follow_the_count(accum, grad)[0]
    assert not commeff_claims.bytes_follow_the_count(accum, grad + 4)[0]
    assert commeff_claims.every_step_took_the_global_batch(accum, 16)[0]
    assert not commeff_claims.every_step_took_the_global_batch(accum, 32)[0]
    assert commeff_claims.same_loss(accum, (2, "no_sync"), tol=1e-4)[0]
    assert not commeff_claims.same_loss({"a": runs["fp32"], "b": runs["bf16"]}, "a", tol=0.0)[0]
    assert commeff_claims.sends_each_step({"fp32": runs["fp32"], "bf16": runs["bf16"]}, grad)[0]
    assert not commeff_claims.sends_each_step({"fp32": runs["fp32"]}, grad // 2)[0]
    assert commeff_claims.allreduces_each_step(runs["naive x2"], 2)[0]
    assert not commeff_claims.allreduces_each_step(runs["naive x2"], 1)[0]
    table = pd.DataFrame({"peak memory growth (MB)": [30.0, 20.0]},
                         index=pd.MultiIndex.from_tuples([(1, "no_sync"), (8, "no_sync")]))
    assert commeff_claims.accumulation_cuts_peak_memory(table)[0]
    assert not commeff_claims.accumulation_cuts_peak_memory(table.iloc[::-1].set_axis(table.index))[0]


def test_the_powersgd_and_hook_claims_read_the_counts():
    shapes = [torch.Size([100, 50]), torch.Size([50])]
    fp32, low = 4 * 5050, commeff.powersgd_payload(shapes, rank=1)
    good = fake_run([1, 1, 3, 3], [fp32, fp32, low, low])
    late = fake_run([1, 3, 3, 3], [fp32, low, low, low])
    assert commeff_claims.powersgd_warms_up_uncompressed(good, fp32)[0]
    assert not commeff_claims.powersgd_warms_up_uncompressed(late, fp32)[0]
    assert commeff_claims.powersgd_issues_three_collectives(good)[0]
    assert not commeff_claims.powersgd_issues_three_collectives(fake_run([1, 1, 3, 2], [fp32] * 4))[0]
    assert commeff_claims.powersgd_sends_its_prediction(good, shapes, rank=1)[0]
    assert not commeff_claims.powersgd_sends_its_prediction(good, shapes, rank=2)[0]
    assert commeff_claims.sends_under(good, fp32, 1 / 5)[0] and not commeff_claims.sends_under(good, fp32, low / fp32)[0]
    assert commeff_claims.sends_less(good, than=fake_run([1] * 4, [fp32] * 4))[0]
    assert not commeff_claims.sends_less(good, than=good)[0]
    assert commeff_claims.loss_fell({"a": good}, by=0.2)[0] and not commeff_claims.loss_fell({"a": good}, by=0.5)[0]
    assert commeff_claims.bytes_per_element({"fp16": fake_run([1], [2 * 5050])}, 5050, {"fp16": 2})[0]
    assert not commeff_claims.bytes_per_element({"fp16": fake_run([1], [4 * 5050])}, 5050, {"fp16": 2})[0]
    final = pd.DataFrame({"final loss": {"allreduce (fp32)": 3.0, "fp16": 3.001, "bf16": 3.002, "PowerSGD r1": 3.5,
                                         "PowerSGD r4": 3.2}})
    assert commeff_claims.powersgd_lags_the_exact_run(final)[0] and commeff_claims.casts_end_with_the_exact_run(final)[0]
    final.loc["PowerSGD r4", "final loss"], final.loc["bf16", "final loss"] = 3.6, 3.1
    assert not commeff_claims.powersgd_lags_the_exact_run(final)[0]
    assert not commeff_claims.casts_end_with_the_exact_run(final)[0]
    assert commeff_claims.torch_bf16_hook_refused("TypeError: needs NCCL")[0]
    assert commeff_claims.torch_bf16_hook_refused("registered and ran")[0] == torch.cuda.is_available()


def test_the_wire_share_is_judged_from_the_step_and_the_lone_all_reduce():
    run = fake_run([1] * 4, [400] * 4)                     # 10 ms per step
    wire = pd.DataFrame({"time_s": [0.001]}, index=pd.Index([400], name="size_bytes"))
    step_ms, table = commeff.wire_shares(run, wire, {"fp32": 400})
    assert step_ms == pytest.approx(10.0) and table.loc["fp32", "share of an fp32 step"] == pytest.approx(0.1)
    assert "10.0%" in commeff_claims.fp32_wire_is_a_small_share(SimpleNamespace(value=(run, wire, {"fp32": 400})))
    slow = wire.assign(time_s=0.005)
    with pytest.raises(AssertionError):
        commeff_claims.fp32_wire_is_a_small_share(SimpleNamespace(value=(run, slow, {"fp32": 400})))
    table = pd.DataFrame({"allreduces": [9.0, 4.0, 1.0]},
                         index=pd.MultiIndex.from_tuples([("tiny", 0.01), ("tiny", 0.1), ("tiny", 25.0)],
                                                         names=["model", "cap"]))
    assert commeff_claims.fewer_allreduces_as_buckets_grow(table)[0]
    assert not commeff_claims.fewer_allreduces_as_buckets_grow(table.assign(allreduces=[4.0, 9.0, 1.0]))[0]
    assert isinstance(commeff.draw_buckets(layers=6, per_bucket=2), Figure)


def test_the_precision_claims_read_the_facts_and_the_scaler_history():
    facts = precision.autocast_facts(RunConfig(world_size=2), batch_size=8)
    assert precision.output_dtype_is(facts, "bf16", "bfloat16")[0]
    assert not precision.output_dtype_is(facts, "bf16", "float32")[0]
    assert precision.bf16_halves_the_layer_output(facts)[0] and precision.gradients_stay_fp32(facts)[0]
    assert precision.backward_keeps_about_half(facts)[0] and not precision.backward_keeps_about_half(facts, 0.8, 1)[0]
    history = pd.DataFrame({"scale": [8.0, 4.0, 4.0, 4.0], "grads finite": [False, True, True, True],
                            "weights changed": [False, True, True, True], "scale after": [4.0, 4.0, 4.0, 8.0]})
    for claim in (precision.first_step_overflowed, precision.steps_taken_exactly_when_finite,
                  precision.every_overflow_halves_the_scale, precision.scale_grew_after_clean_steps):
        assert claim(history)[0]
    broken = history.assign(**{"weights changed": [True, True, True, True], "scale after": [8.0, 4.0, 4.0, 4.0]})
    for claim in (precision.first_step_overflowed, precision.steps_taken_exactly_when_finite,
                  precision.every_overflow_halves_the_scale, precision.scale_grew_after_clean_steps):
        assert not claim(broken)[0]
