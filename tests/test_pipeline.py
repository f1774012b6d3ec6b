"""Pipeline parallelism (strategy "pp"): the measurements as pure functions, the config rules, and real gloo ranks:
every schedule's gradients against the unsplit model, PP x DP on 4 ranks, the traps (a silent wrong gradient
caught, a hang bounded and named, a size mismatch aborting, shape inference without numpy), activations in flight
and messages counted."""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

import labkit
from labkit import ConfigError, RunConfig
from labkit.training.parallel.pipeline import CHECK_RTOL, split_gpt2, stage_ranks
from labkit.measure import pin_rank
from labkit.training.parallel.pipetrace import (StageTrace, bubble_fractions, gpipe_bubble, idle_split, in_flight,
                                                interleaved_bubble, message_waits, step_summary)
from labkit.training.tasks import make_task
from labkit.tricks import pipeline as pp
from labkit.tricks import pipeline_traps as traps

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2),
             ("ZBVZeroBubble", 2), ("DualPipeV", 2)]


def small(schedule: str = "1F1B", v: int = 1, **fields) -> RunConfig:
    base = dict(strategy="pp", world_size=2, layers=4, global_batch=16, microbatches=4, pipeline_schedule=schedule,
                stages_per_rank=v, steps=2, tensorboard=False, save_final=False)
    return RunConfig(**{**base, **fields})


# ---------------------------------------------------------------- pure functions

def test_bubble_fraction_is_idle_over_the_makespan_per_rank():
    # two ranks, one microbatch: rank 1 starts when rank 0 ends, each computes half of the 4 s makespan
    f = lambda kind, stage, t0, t1: [kind, stage, 0, t0, t1, 0]  # noqa: E731
    by_rank = {0: [f("F", 0, 0.0, 1.0), f("B", 0, 3.0, 4.0)], 1: [f("F", 1, 1.0, 2.0), f("B", 1, 2.0, 3.0)]}
    assert bubble_fractions(by_rank) == {0: 0.5, 1: 0.5}
    assert bubble_fractions({}) == {}


def test_idle_splits_into_waiting_for_compute_and_between_actions():
    # rank 1 waits 1 s for rank 0's F, then 0.5 s for the message; rank 0 waits for rank 1's B, then 0.5 s again
    f = lambda kind, stage, t0, t1: [kind, stage, 0, t0, t1, 0]  # noqa: E731
    by_rank = {0: [f("F", 0, 0.0, 1.0), f("B", 0, 3.5, 4.5)], 1: [f("F", 1, 1.5, 2.5), f("B", 1, 2.5, 3.0)]}
    split = idle_split(by_rank)
    assert split[0] == pytest.approx((2.0 / 4.5, 0.5 / 4.5)) and split[1] == pytest.approx((2.5 / 4.5, 0.5 / 4.5))
    bubbles = bubble_fractions(by_rank)
    assert all(sum(split[r]) == pytest.approx(bubbles[r]) for r in by_rank)
    assert sorted(message_waits(by_rank)) == [(0, "B0 of stage 0", 0.5), (1, "F0 of stage 1", 0.5)]
    got = step_summary(by_rank)  # rank 0 computed 2 s, rank 1 1.5 s: rank 0 is the slowest stage
    assert got["bubble"] == pytest.approx(bubbles[0]) and got["between"] == pytest.approx(0.5 / 4.5)
    assert got["imbalance"] == pytest.approx((bubbles[0] + bubbles[1]) / 2 - bubbles[0])
    assert got["wait_s"] == 0.5 and got["f_s"] == 1.0


def test_a_message_wait_counts_from_the_later_of_input_and_free_rank_and_skips_same_rank_stages():
    f = lambda kind, stage, mb, t0, t1: [kind, stage, mb, t0, t1, 0]  # noqa: E731
    # rank 1 was still busy with F0 when rank 0's F1 ended: its F1 waited from its own F0's end
    by_rank = {0: [f("F", 0, 0, 0.0, 1.0), f("F", 0, 1, 1.0, 2.0), f("F", 3, 0, 9.0, 9.5), f("W", 0, 0, 9.5, 9.6)],
               1: [f("F", 1, 0, 1.2, 3.0), f("F", 1, 1, 3.1, 4.0), f("F", 2, 0, 4.0, 5.0)]}
    waits = {name: w for _, name, w in message_waits(by_rank)}
    assert waits["F0 of stage 1"] == pytest.approx(0.2) and waits["F1 of stage 1"] == pytest.approx(0.1)
    assert waits["F0 of stage 3"] == pytest.approx(4.0)   # stage 2 is on rank 1: a message; W needs none
    assert "F0 of stage 2" not in waits                  # stage 1 is on the same rank: no message


def test_the_loss_counts_as_the_last_stages_forward():
    class Stage:
        stage_index, is_last = 1, True

        def forward_one_chunk(self, mb, *args, **kwargs):
            return torch.ones(3, requires_grad=True) * 2

        backward_one_chunk = backward_weight_one_chunk = forward_one_chunk

    class Schedule:
        def _maybe_compute_loss(self, stage, output, target_mbs, mb, loss_kwargs=None):
            time.sleep(0.02)
            return (output.exp() * 2).sum()  # saves a tensor: its bytes count too

    stage, schedule, trace = Stage(), Schedule(), StageTrace()
    trace.watch(stage)
    trace.watch_loss(schedule)
    out = stage.forward_one_chunk(0)
    schedule._maybe_compute_loss(stage, out, [None], 0)
    (row,) = trace.take()
    assert row[:3] == ["F", 1, 0] and row[4] - row[3] >= 0.02 and row[5] > 0


def _pinned_threads(queue) -> None:
    threading.Thread(target=time.sleep, args=(0.5,), daemon=True).start()  # a thread started before the pin
    core = pin_rank(1)
    queue.put({t: os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")} | {"core": core})


def test_pin_rank_pins_every_thread_of_the_rank():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable cores")
    queue = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_pinned_threads, args=(queue,))
    child.start()
    masks = queue.get(timeout=10)
    child.join(timeout=10)
    core = masks.pop("core")
    assert len(masks) >= 2 and all(mask == {core} for mask in masks.values()), masks


def test_the_formulas():
    assert gpipe_bubble(2, 1) == 0.5 and gpipe_bubble(4, 4) == 3 / 7
    assert interleaved_bubble(2, 4, 1) == gpipe_bubble(2, 4)
    assert interleaved_bubble(4, 8, 2) == 3 / 19
    assert pp.formula(small("LoopedBFS", 2)) == interleaved_bubble(2, 4, 2)
    assert math.isnan(pp.formula(small("ZBVZeroBubble", 2))) and math.isnan(pp.formula(small("DualPipeV", 2)))
    theirs = pp.their_models(2, 4)
    assert theirs.iloc[:, 1].tolist()[:3] == [gpipe_bubble(2, 4), 1 / 13, 0.0]  # 1F1B, ZB1P (p-1)/3m, ZBV


def test_in_flight_replays_forwards_and_backwards_in_start_order():
    acts = [["F", 0, 0, 0, 1, 10], ["F", 0, 1, 1, 2, 10], ["B", 0, 0, 2, 3, 0], ["F", 0, 2, 3, 4, 10],
            ["I", 0, 1, 4, 5, 0], ["W", 0, 1, 5, 6, 0], ["F", 1, 0, 1, 2, 7], ["B", 1, 0, 2, 3, 0]]
    assert in_flight(list(reversed(acts))) == {0: (2, 20), 1: (1, 7)}


def test_stage_placement_matches_torch():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    for ranks, v in ((2, 2), (4, 2), (2, 3)):
        assert stage_ranks("Interleaved1F1B", ranks, v) == generate_stage_to_rank_mapping(ranks, ranks * v, "loop")
    for ranks in (2, 4):
        assert stage_ranks("DualPipeV", ranks, 2) == generate_stage_to_rank_mapping(ranks, ranks * 2, "v")


def test_stages_chained_compute_the_whole_model():
    cfg = RunConfig(layers=4, global_batch=4, world_size=1)
    task = make_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    inputs, _ = task.batch(0, 0, 0)
    x = inputs
    for stage in split_gpt2(model, 4):
        x = stage(x)
    assert torch.allclose(x, model(input_ids=inputs).logits, atol=1e-5)  # causal without a mask, as GPT-2 is
    with pytest.raises(ValueError, match="multiple of 3"):
        split_gpt2(model, 3)


# ---------------------------------------------------------------- config rules

@pytest.mark.parametrize("fields, named", [
    ({"world_size": 4, "pipeline_ranks": 3}, "RunConfig.pipeline_ranks = 3"),
    ({"microbatches": 3}, "RunConfig.microbatches = 3: must divide"),
    ({"pipeline_schedule": "1F1B", "microbatches": 1, "layers": 2}, "needs at least as many microbatches"),
    ({"pipeline_schedule": "DualPipeV", "stages_per_rank": 2, "microbatches": 2}, "needs at least as many"),
    ({"pipeline_schedule": "Interleaved1F1B", "stages_per_rank": 2, "microbatches": 9, "global_batch": 36,
      "world_size": 4, "layers": 8}, "multiple of the rounds"),
    ({"pipeline_schedule": "ZBVZeroBubble", "stages_per_rank": 1}, "needs exactly 2 stages per rank"),
    ({"pipeline_schedule": "LoopedBFS", "stages_per_rank": 1}, "use 2 or more"),
    ({"pipeline_schedule": "GPipe", "stages_per_rank": 2}, "runs one stage per rank"),
    ({"layers": 3}, "RunConfig.layers = 3"),
    ({"pipeline_schedule": "gpipe"}, "RunConfig.pipeline_schedule = 'gpipe': must be one of GPipe"),
    ({"grad_accum": 2, "global_batch": 32}, "RunConfig.grad_accum = 2"),
    ({"task": "digits"}, "RunConfig.task must be 'tinylm'"),
])
def test_config_rejects_what_a_pipeline_cannot_do(fields, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
        small(**fields)


def test_pipeline_dims_multiply_to_the_world():
    assert small(world_size=4, pipeline_ranks=2).pipeline_dims == (2, 2)
    assert small().pipeline_dims == (1, 2)
    assert RunConfig().pipeline_dims == (2, 1)


# ---------------------------------------------------------------- real gloo ranks

def _one_process_loss(cfg: RunConfig) -> list[float]:
    run = labkit.launch(cfg.replace(strategy="ddp", world_size=1, name="one"), echo=False, progress=False)
    return run.steps()["loss"].tolist()


def test_every_schedule_trains_the_unsplit_model(tmp_path):
    """pipeline_check compares every gradient with the unsplit model's on step 0 and raises above CHECK_RTOL
    (1e-4 of the parameter's largest gradient); the losses then follow one process's to float32 rounding."""
    one = _one_process_loss(small())
    for schedule, v in SCHEDULES:
        run = labkit.launch(small(schedule, v), echo=False, progress=False, runs_root=tmp_path)
        errors = run.df.dropna(subset=["pp_check"]).pp_check
        assert len(errors) == 2 and errors.max() < CHECK_RTOL, schedule
        assert run.steps()["loss"].tolist() == pytest.approx(one, abs=1e-5), schedule
        assert run.df.groupby("step").samples.sum().tolist() == [16, 16]  # each sample once
        assert run.df.loss.notna().sum() == 2  # only the last stage's rank has a loss


def test_pp_times_dp_on_a_2d_mesh(tmp_path):
    cfg = small(world_size=4, pipeline_ranks=2, layers=2)
    run = labkit.launch(cfg, echo=False, progress=False, runs_root=tmp_path)
    assert run.df.dropna(subset=["pp_check"]).pp_check.max() < CHECK_RTOL
    assert run.steps()["loss"].tolist() == pytest.approx(_one_process_loss(cfg), abs=1e-5)
    assert sorted(run.df[run.df.step == 0].pp_stages.map(tuple)) == [(0,), (0,), (1,), (1,)]


def test_fixed_shapes_without_requires_grad_are_caught_on_step_one(tmp_path):
    labkit.launch(small(pipeline_shapes="fixed"), echo=False, progress=False, runs_root=tmp_path)  # passes
    with pytest.raises(labkit.RankFailure, match=r"PipelineGradientError: stage 0 .*transformer\.w[pt]e"):
        labkit.launch(small(pipeline_shapes="fixed_no_grad"), echo=False, progress=False, runs_root=tmp_path)
    silent = labkit.launch(small(pipeline_shapes="fixed_no_grad", pipeline_check=False), echo=False,
                           progress=False, runs_root=tmp_path)  # the trap: no error, a different training
    assert silent.steps()["loss"].iloc[1] != pytest.approx(_one_process_loss(small())[1], abs=1e-4)


def test_a_microbatch_count_mismatch_hangs_bounded_and_named(tmp_path):
    failure, where = traps.mismatched_microbatches(pp.lesson_config("GPipe", microbatches=4, global_batch=16),
                                                timeout=4, runs_root=tmp_path)
    assert failure.reason == "hung" and "_wait_batch_p2p" in failure.detail
    assert where[0].startswith("after F1 of stage 0") and where[1].startswith("after F1 of stage 1")


def test_a_size_mismatch_aborts_the_rank_and_names_the_stage(tmp_path):
    failure, where = traps.mismatched_sizes(pp.lesson_config("GPipe", microbatches=4, global_batch=16),
                                         runs_root=tmp_path)
    assert failure.reason == "signal" and "SIGABRT" in failure.detail and failure.rank == 0  # received the gradient
    assert "stage 0" in where[0] and "stage 1" in where[1]


def test_shape_inference_without_numpy_names_numpy_on_one_rank_and_a_closed_connection_on_the_other(
        tmp_path, no_leftovers):
    failure, saw = traps.without_numpy(pp.lesson_config("GPipe", microbatches=2, global_batch=8), rank=1,
                                    runs_root=tmp_path)
    assert failure.rank == 1 and failure.reason == "raised" and "Numpy is not available" in saw[1]
    # gloo words the lost connection by when it noticed (as in test_failures): mid-read "Read error ... Connection
    # reset by peer" (seen once with a core busy), otherwise "Connection closed by peer"
    assert "Read error" in saw[0] or "Connection closed by peer" in saw[0], saw[0]
    assert traps.ranks_left(failure.run_dir) == []


def test_1f1b_holds_fewer_activations_than_gpipe_and_both_send_one_message_per_microbatch(tmp_path):
    runs = {s: pp.run_pipeline(pp.lesson_config(s, microbatches=4, global_batch=16, steps=pp.STEADY_FROM + 1),
                               pinned=False, runs_root=tmp_path) for s in ("GPipe", "1F1B")}
    gpipe, ofob = pp.held(runs["GPipe"]), pp.held(runs["1F1B"])
    assert gpipe[0][0] == 4 and ofob[0][0] == 2 and ofob[1][0] == 1  # m on stage 0, at most p under 1F1B
    assert ofob[0][1] * 2 == gpipe[0][1]  # the same bytes per microbatch, half as many held
    for run in runs.values():
        sent = pp.messages(run)
        assert sent.n_send.tolist() == [4, 4] and sent.n_recv.tolist() == [4, 4]
        assert sent.bytes_send.tolist() == [4 * 4 * 32 * 128 * 4] * 2  # 4 rows x 32 tokens x width 128, fp32
        assert pp.bubble(run).keys() == {0, 1}
        got = pp.summary(run)   # read from the one steady step: fractions of it, and positive times
        # between == bubble is possible: when the slowest rank is slowed so much (a busy core) that its peer's work is
        # always ready before it is free, it never waits on the peer and all its idle is between actions
        assert 0 < got["between"] <= got["bubble"] < 1 and got["wait_ms"] > 0 and got["f_ms"] > 0
        assert pp.parameter_shares(run)[1] == pytest.approx(1.0, abs=0.02)  # the tied embedding at both ends: +1%


def test_placement_matches_torch_for_every_layout():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    mapping = lambda s, style: generate_stage_to_rank_mapping(2, 4, style)  # noqa: E731
    assert pp.placement(pp.lesson_config("GPipe")) == {0: 0, 1: 1}
    assert pp.placement(pp.lesson_config("Interleaved1F1B")) == mapping(2, "loop")
    assert pp.placement(pp.lesson_config("DualPipeV")) == pp.placement(pp.lesson_config("ZBVZeroBubble")) \
        == mapping(2, "v")


def _sweep(rows):
    import types
    import pandas as pd
    return types.SimpleNamespace(table=pd.DataFrame(rows))


def test_the_gated_checks_assert_on_the_sweep_they_are_given():
    row = dict(run="r", m=4, measured=0.21, formula=0.2, **{"between actions": 0.02, "wait (ms)": 0.5,
                                                              "forward (ms)": 20.0})
    ok = _sweep([dict(row, schedule="1F1B"), dict(row, schedule="Interleaved1F1B", measured=0.15, formula=0.111,
                                                   **{"between actions": 0.06}),
                 dict(row, schedule="ZBVZeroBubble", measured=0.1)])
    assert "largest gap" in pp.bubbles_follow_the_formula(_sweep([row]))
    assert "of a forward" in pp.messages_wait_little(ok)
    assert pp.ramp_follows_the_interleaved_formula(ok).startswith("0.090")
    assert "1F1B's 0.020" in pp.interleaving_idles_more_between_actions(ok)
    assert "1F1B's 0.210" in pp.BubbleBelow1F1B("ZBVZeroBubble")(ok)
    assert "1F1B's 0.190" in pp.BubbleBelow1F1B("Interleaved1F1B", less_between=True)(ok)
    with pytest.raises(AssertionError, match="bubble vs formula"):
        pp.bubbles_follow_the_formula(_sweep([dict(row, measured=0.35)]))
    with pytest.raises(AssertionError, match="waited"):
        pp.messages_wait_little(_sweep([dict(row, **{"wait (ms)": 5.0})]))
    with pytest.raises(AssertionError, match="ZBVZeroBubble 0.300"):
        pp.BubbleBelow1F1B("ZBVZeroBubble")(_sweep([dict(row, schedule="1F1B"),
                                                    dict(row, schedule="ZBVZeroBubble", measured=0.3)]))
    with pytest.raises(AssertionError, match="interleaved 0.010"):
        pp.interleaving_idles_more_between_actions(_sweep([dict(row, schedule="1F1B"), dict(
            row, schedule="Interleaved1F1B", **{"between actions": 0.01})]))


def test_messages_as_placed_and_parameter_shares_read_what_the_ranks_did(tmp_path, monkeypatch):
    run = pp.run_pipeline(pp.lesson_config("DualPipeV", microbatches=4, global_batch=16, steps=pp.STEADY_FROM + 1),
                          pinned=False, runs_root=tmp_path)
    table, ok = pp.messages_as_placed(run)
    assert ok and table.sends.tolist() == [8, 8] and table["receives (placement)"].tolist() == [8, 8]
    shares, copies = pp.parameter_shares(run)
    assert copies == pytest.approx(1.0, abs=0.01) and all(0.4 < s < 0.6 for s in shares.values())
    counted = pp.messages(run)
    monkeypatch.setattr(pp, "messages", lambda r: counted.assign(n_send=[12, 8]))   # a rank that sent too much
    assert pp.messages_as_placed(run)[1] is False
