import numpy as np
import pandas as pd
import pytest

from labkit import RunConfig
from labkit.tricks import scaling
from labkit.tricks.scaling import (global_batch, grad_accum_to_fit, linear_scaling_lr, loss_near, oversubscribed,
                            scaling_efficiency, speedup, warmup_steps_for)


def test_global_batch_is_world_times_per_rank_times_accumulation():
    assert global_batch(2, 16) == 32
    assert global_batch(world_size=8, batch_per_rank=32, grad_accum=2) == 512
    cfg = RunConfig.per_rank(batch_per_rank=16, world_size=2, grad_accum=4)
    assert global_batch(cfg.world_size, cfg.batch_per_rank, cfg.grad_accum) == cfg.global_batch == 128


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_global_batch_rejects_non_positive_integers_by_name(bad):
    with pytest.raises(ValueError, match="grad_accum"):
        global_batch(2, 16, bad)


def test_scaling_efficiency_is_throughput_over_n_times_one_rank():
    eff = scaling_efficiency({1: 1000.0, 2: 1800.0, 4: 2000.0})
    assert eff == pytest.approx({1: 1.0, 2: 0.9, 4: 0.5})
    assert list(eff) == [1, 2, 4]
    assert speedup({4: 2000.0, 1: 1000.0}) == pytest.approx({1: 1.0, 4: 2.0})


def test_scaling_efficiency_accepts_numpy_numbers():
    eff = scaling_efficiency({np.int64(1): np.float64(10.0), np.int64(2): np.float64(15.0)})
    assert eff == {1: 1.0, 2: 0.75} and all(type(k) is int and type(v) is float for k, v in eff.items())


def test_scaling_efficiency_needs_one_rank_and_positive_throughputs():
    with pytest.raises(ValueError, match="world size 1"):
        scaling_efficiency({2: 1.0, 4: 1.0})
    with pytest.raises(ValueError, match="throughput at world 2"):
        scaling_efficiency({1: 1.0, 2: float("nan")})
    with pytest.raises(ValueError, match="world size"):
        scaling_efficiency({1: 1.0, 0: 1.0})


def test_linear_scaling_rule_multiplies_the_lr_by_the_batch_ratio():
    assert linear_scaling_lr(0.1, base_batch=256, batch=8192) == pytest.approx(3.2)   # Goyal et al.'s k = 32
    assert linear_scaling_lr(0.03, base_batch=32, batch=256) == pytest.approx(0.24)
    assert linear_scaling_lr(0.2, base_batch=64, batch=32) == pytest.approx(0.1)      # smaller batch: smaller lr
    assert linear_scaling_lr(0.2, base_batch=64, batch=64) == 0.2
    with pytest.raises(ValueError, match="base_lr"):
        linear_scaling_lr(0.0, base_batch=32, batch=64)
    with pytest.raises(ValueError, match="batch"):
        linear_scaling_lr(0.1, base_batch=32, batch=0)


def test_warmup_steps_cover_the_same_samples_at_any_batch():
    assert warmup_steps_for(samples=1437, global_batch=256) == 6
    assert warmup_steps_for(samples=1437, global_batch=32) == 45
    assert warmup_steps_for(samples=10, global_batch=256) == 1   # never zero steps


def test_grad_accum_to_fit_keeps_the_global_batch_and_splits_evenly():
    assert grad_accum_to_fit(global_batch=512, world_size=2, max_batch_per_rank=64) == 4
    assert grad_accum_to_fit(global_batch=512, world_size=2, max_batch_per_rank=256) == 1
    assert grad_accum_to_fit(global_batch=512, world_size=2, max_batch_per_rank=100) == 4   # 128 > 100, 64 fits
    assert grad_accum_to_fit(global_batch=96, world_size=2, max_batch_per_rank=20) == 3     # 48 = 3 x 16
    assert grad_accum_to_fit(global_batch=14, world_size=2, max_batch_per_rank=3) == 7      # 7 is prime: 1 each
    for accum in (grad_accum_to_fit(1024, 4, m) for m in (1, 7, 50, 256)):
        RunConfig(world_size=4, global_batch=1024, grad_accum=accum)                         # RunConfig accepts it
    with pytest.raises(ValueError, match="does not split"):
        grad_accum_to_fit(global_batch=513, world_size=2, max_batch_per_rank=64)


def test_loss_near_averages_the_window_of_samples_seen():
    seen, loss = [32, 64, 96, 128], [4.0, 3.0, 2.0, 1.0]
    assert loss_near(seen, loss, at=128, window=64) == pytest.approx(1.5)   # (64, 128]: the last two
    assert loss_near(np.array(seen), np.array(loss), at=100, window=50) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="widen the window"):
        loss_near(seen, loss, at=1000, window=10)
    with pytest.raises(ValueError, match="window"):
        loss_near(seen, loss, at=128, window=0)


def test_oversubscribed_means_more_ranks_than_cores():
    assert oversubscribed(4, 2) and not oversubscribed(2, 2) and not oversubscribed(1, 2)


def test_a_layout_gets_the_linear_rule_lr_and_an_epoch_of_warmup():
    row = scaling.layout(8, 32, 2, base_lr=0.03, base_batch=32, epoch_samples=1437)
    assert row["global batch"] == 512 and row["lr (linear rule)"] == pytest.approx(0.48)
    assert row["warmup steps (1 epoch)"] == 3 and (row["ranks"], row["per rank"], row["accumulation"]) == (8, 32, 2)


def test_the_sweep_table_and_its_figure_come_from_measured_runs(runs_root, no_leftovers):
    from labkit.measure import interleaved
    cfg = RunConfig.per_rank(batch_per_rank=4, world_size=1, task="tinylm", steps=5, optimizer="sgd", lr=0.01,
                             tensorboard=False, save_final=False)
    timed = interleaved({"w1": cfg, "w2": cfg.replace(world_size=2, global_batch=8)}, rounds=1, cores=2,
                        runs_root=runs_root)
    table = scaling.sweep_table(timed, cores=1)
    assert list(table.index) == [("tiny", 4, 1), ("tiny", 4, 2)]
    one, two = table["samples/s"].tolist()
    assert table["efficiency"].tolist() == pytest.approx([1.0, two / (2 * one)])
    assert table["speedup"].tolist() == pytest.approx([1.0, two / one])
    assert table["allreduce_MB"].iloc[0] == 0 < table["allreduce_MB"].iloc[1]     # one rank sends nothing
    assert table["ranks per core"].tolist() == ["1", "2 (oversubscribed)"]
    assert table["others' cores"].tolist() == [timed["w1"].others, timed["w2"].others]
    fig = scaling.plot_scaling(table, cores=1)
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel() == "efficiency"


def test_accumulation_trains_as_the_one_batch_does_and_the_check_sees_a_difference(runs_root, no_leftovers):
    """Lesson 03's fix cell asserts losses equal to the one-batch run's within 1e-5: that holds for accumulation,
    and fails for a run that really trains differently (here: a slightly different learning rate)."""
    import labkit
    one = RunConfig(task="tinylm", world_size=2, global_batch=32, steps=3, optimizer="sgd", lr=0.01,
                    tensorboard=False, save_final=False)
    runs = {name: labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False)
            for name, cfg in {"one": one, "accum": one.replace(grad_accum=4), "other": one.replace(lr=0.011)}.items()}
    loss = {name: run.steps()["loss"] for name, run in runs.items()}
    assert (runs["accum"].df.groupby("step")["samples"].sum() == 32).all()
    assert (loss["accum"] - loss["one"]).abs().max() < 1e-5
    assert (loss["other"] - loss["one"]).abs().max() > 1e-5


def test_the_two_warmup_ramps_start_apart_and_meet_at_the_peak():
    ramps = scaling.warmup_ramps(0.03, k=8, warmup_steps=6)
    kit, goyal = ramps["labkit (from peak/warmup)"], ramps["Goyal et al. (from base_lr)"]
    assert kit.iloc[0] == pytest.approx(0.24 / 6) and goyal.iloc[0] == pytest.approx(0.03)   # peak/warmup vs eta
    assert kit.iloc[-1] == goyal.iloc[-1] == pytest.approx(0.24)
    assert (kit.diff().dropna() >= 0).all() and (goyal.diff().dropna() > 0).all()
    from labkit.training.lr import lr_at                                   # the schedule labkit really runs
    assert kit.tolist() == pytest.approx([lr_at(s, peak=0.24, steps=100, warmup_steps=6) for s in range(7)])


def test_replay_one_process_is_what_ddp_with_accumulation_ends_with(runs_root, no_leftovers):
    import contextlib
    import torch
    import labkit
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Linear(3, 1)

    def loss_fn(model, x):
        return model(x).square().mean()

    def ranks(ctx):
        model, seen, data = DDP(make_model()), [], torch.Generator().manual_seed(ctx.rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for micro in range(2):
                seen.append(torch.randn(2, 3, generator=data))
                with model.no_sync() if micro == 0 else contextlib.nullcontext():
                    (loss_fn(model, seen[-1]) / 2).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()], seen

    run = labkit.launch(ranks, world_size=2, runs_root=runs_root, echo=False, progress=False)
    (params, seen0), (_, seen1) = run.result(0), run.result(1)
    batches = [torch.cat([seen0[2 * s], seen0[2 * s + 1], seen1[2 * s], seen1[2 * s + 1]]) for s in range(2)]
    one = scaling.replay_one_process(make_model(), batches, loss_fn, lr=0.1)
    assert max(float((a - b).abs().max()) for a, b in zip(params, one)) < 1e-6
    other = scaling.replay_one_process(make_model(), batches, loss_fn, lr=0.11)
    assert max(float((a - b).abs().max()) for a, b in zip(params, other)) > 1e-4


def _timed_table(monkeypatch, table):
    """A stand-in Timings whose sweep_table is `table` (the checks read only the table and the cores)."""
    from types import SimpleNamespace
    monkeypatch.setattr(scaling, "sweep_table", lambda timed, cores: table)
    return SimpleNamespace(settings={"cores": 2})


def _sweep(samples, fwd_bwd, eff):
    index = pd.MultiIndex.from_tuples(list(samples), names=["model", "batch per rank", "world"])
    return pd.DataFrame({"samples/s": list(samples.values()), "fwd_bwd_ms": [fwd_bwd.get(k, 1.0) for k in samples],
                         "efficiency": [eff.get(k, 1.0) for k in samples]}, index=index)


def test_the_sweep_checks_pass_on_what_they_claim_and_fail_otherwise(monkeypatch):
    keys = [("tiny", 8, 1), ("tiny", 128, 1), ("small", 8, 1), ("tiny", 8, 2), ("tiny", 128, 2), ("small", 8, 2),
            ("tiny", 8, 4), ("tiny", 128, 4)]
    good = _sweep(dict(zip(keys, [100, 200, 50, 150, 300, 80, 120, 220])),
                  {("tiny", 8, 1): 1.0, ("tiny", 128, 1): 10.0, ("small", 8, 1): 4.0},
                  {("tiny", 8, 2): 0.75, ("tiny", 128, 2): 0.75, ("small", 8, 2): 0.8,
                   ("tiny", 8, 4): 0.3, ("tiny", 128, 4): 0.3})
    mb = pd.Series({("tiny", 8): 0.4, ("tiny", 128): 0.4, ("small", 8): 3.2})
    timed = _timed_table(monkeypatch, good)
    assert scaling.larger_batch_more_samples_per_s(timed) == "2.00x"
    assert scaling.larger_batch_more_compute_per_mb(timed, mb).startswith("10.0x")
    assert "0.40 of the 2-rank efficiency" in scaling.oversubscription_costs(timed)
    bad = good.assign(efficiency=1.0)           # 4 ranks as efficient as 2: no oversubscription cost
    with pytest.raises(AssertionError):
        scaling.oversubscription_costs(_timed_table(monkeypatch, bad))


def test_large_batch_runs_faster_compares_b_and_c_with_a():
    from types import SimpleNamespace
    timed = {key: SimpleNamespace(run=SimpleNamespace(summary=lambda v=v: {"median_samples_per_s": v}))
             for key, v in {"A": 100.0, "B": 400.0, "C": 160.0}.items()}
    assert scaling.large_batch_runs_faster(timed) == "1.6x"
    timed["C"] = SimpleNamespace(run=SimpleNamespace(summary=lambda: {"median_samples_per_s": 140.0}))
    with pytest.raises(AssertionError):
        scaling.large_batch_runs_faster(timed)


def _rounds(step_s: dict[str, list[float]]):
    """A measure.Timings whose repeats hold these steps (one per round), as interleaved leaves them."""
    from labkit.measure import Timing, Timings
    timings = {label: Timing(label, None, min(steps), 1.0, 0.0, tuple((0.0, s) for s in steps))
               for label, steps in step_s.items()}
    return Timings(timings, {label: None for label in step_s}, {"rounds": 3, "cores": 2, "warmup": 1})


def test_two_ranks_scale_on_the_median_of_efficiencies_paired_round_by_round():
    # tiny x 8: 0.5, 0.8, 0.9 (one slow 2-rank round); small x 8: 0.7, 0.6, 0.75. Median 0.725.
    timed = _rounds({"tiny 1 x 8": [1.0, 1.0, 0.9], "tiny 2 x 8": [2.0, 1.25, 1.0],
                     "small 1 x 8": [0.7, 0.6, 0.75], "small 2 x 8": [1.0, 1.0, 1.0], "tiny 4 x 8": [5.0] * 3})
    eff = scaling.round_efficiencies(timed)
    assert eff.loc[("tiny", 8)].tolist() == [0.5, 0.8, 0.9] and len(eff) == 2      # world 4 is not a 2-rank point
    assert scaling.two_ranks_scale(timed) == "median 2-rank efficiency 0.72 (each point and round: 0.50 to 0.90)"
    slow = _rounds({"tiny 1 x 8": [1.0] * 3, "tiny 2 x 8": [2.5, 2.1, 1.5]})   # 0.4, 0.48, 0.67: median under 0.5
    with pytest.raises(AssertionError):
        scaling.two_ranks_scale(slow)
