"""nan_policy on real gloo ranks (one rank's NaN: stop together, skip together, or leave alone and hang),
the local-gradient flag, the clip coefficient as measured, and the bad-batch fault."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import Fault, RankFailure, RunConfig
from labkit.training.inject import BAD_INPUT_SCALE, corrupt_batch
from labkit.training.nonfinite import NanGuard
from labkit.tricks import stability

CFG = RunConfig(world_size=2, steps=6, tensorboard=False, save_final=False)


@pytest.mark.parametrize("culprit", [1, 0])
def test_stop_ends_every_rank_at_the_nan_step_and_names_the_rank_and_parameter(culprit, runs_root, no_leftovers):
    cfg = CFG.replace(nan_policy="stop", faults=(Fault(kind="nan", rank=culprit, step=3),))
    with pytest.raises(RankFailure) as info:
        labkit.launch(cfg, runs_root=runs_root, echo=False, timeout=20)
    failure = info.value
    assert (failure.rank, failure.step, failure.reason) == (culprit, 3, "raised"), str(failure)
    assert "NonFiniteLoss" in failure.detail and f"rank {culprit} went non-finite first" in failure.detail
    assert "first non-finite gradient (in backward's order): transformer." in failure.detail, failure.detail
    df = failure.run.df
    assert df.groupby("rank")["step"].max().tolist() == [3, 3]          # every rank stopped at the same step
    last = df[df["step"] == 3]
    assert last["skipped_step"].tolist() == [1, 1] and last["nonfinite_ranks"].tolist() == [1, 1]
    assert df[df["step"] < 3]["skipped_step"].eq(0).all()


def test_skip_finishes_and_every_rank_records_the_skipped_step(runs_root, no_leftovers):
    run = labkit.launch(CFG.replace(nan_policy="skip", faults=(Fault(kind="nan", rank=1, step=2),)),
                        runs_root=runs_root, echo=False)
    df = run.df
    assert df.groupby("rank")["step"].max().tolist() == [5, 5]
    assert df.pivot(index="step", columns="rank", values="skipped_step").values.tolist() == \
        [[0, 0], [0, 0], [1, 1], [0, 0], [0, 0], [0, 0]]
    assert df.groupby("step")["nonfinite_ranks"].max().tolist() == [0, 0, 1, 0, 0, 0]
    assert df[df["step"] > 2]["loss"].apply(math.isfinite).all()  # the NaN step never reached the weights


def test_ignore_lets_one_ranks_nan_poison_every_rank(runs_root, no_leftovers):
    run = labkit.launch(CFG.replace(nan_policy="ignore", faults=(Fault(kind="nan", rank=1, step=2),)),
                        runs_root=runs_root, echo=False)
    losses = run.df.pivot(index="step", columns="rank", values="loss")
    assert math.isfinite(losses.loc[2, 0]) and math.isnan(losses.loc[2, 1])
    assert losses.loc[3:].isna().all().all()  # after the average, rank 0 is NaN too


def test_alone_leaves_the_peers_waiting_until_the_watchdog_names_the_rank(runs_root, no_leftovers):
    cfg = CFG.replace(nan_policy="alone", faults=(Fault(kind="nan", rank=1, step=2),))
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        labkit.launch(cfg, runs_root=runs_root, echo=False, timeout=2)
    failure = info.value
    assert (failure.rank, failure.reason) == (1, "hung"), str(failure)
    assert "barrier" in failure.detail                            # rank 1 waits where its loop ended
    assert "wait_for_peers" in failure.traceback
    peer = failure.statuses[0]
    assert peer.step == 3 and "waiting inside torch" in peer.detail   # rank 0 went on, into the next step's all-reduce
    assert time.monotonic() - started < 2 + 10


def _grad_goes_inf_on_rank_1(ctx):
    """A finite loss whose gradient overflows on rank 1 only, in one named parameter: the flag must come from
    the local gradients (after DDP's average every rank would see the inf)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    guard = NanGuard("stop", model, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
    if ctx.rank == 1:
        model[0].weight.register_hook(lambda g: g * math.inf)
    guard.start_step()
    loss = ddp(torch.ones(2, 3)).sum()
    loss.backward()
    after_average = torch.isfinite(model[0].weight.grad).all().item()
    return {"bad": guard.agree(loss.item()), "param": guard.first_bad_parameter(), "loss": loss.item(),
            "after_average": after_average}


def test_the_flag_reads_each_ranks_own_gradients_before_the_average(runs_root, no_leftovers):
    run = labkit.launch(_grad_goes_inf_on_rank_1, world_size=2, runs_root=runs_root, echo=False)
    zero, one = run.result(0), run.result(1)
    assert zero["bad"] == one["bad"] == [1]                        # both agree: rank 1, and only rank 1
    assert math.isfinite(one["loss"]) and one["param"] == "0.weight" and zero["param"] is None
    assert not zero["after_average"]                               # averaged, rank 0's copy is not finite either


def test_clip_coefficient_is_below_one_exactly_where_the_norm_exceeded_the_max(runs_root):
    run = labkit.launch(CFG.replace(steps=8, clip_norm=1.2), runs_root=runs_root, echo=False)
    table = stability.clipping(run)
    assert table["acted"].any() and not table["acted"].all()       # the max splits this run's steps
    assert (table["acted"] == (table["grad_norm"] > 1.2)).all()
    assert table.loc[table["acted"], "left"].sub(1.2).abs().max() < 1e-4
    assert (table.loc[~table["acted"], "clip_coef"] == 1.0).all()
    assert run.df.groupby("step")["clip_coef"].nunique().eq(1).all()  # the same on every rank


def test_bad_batch_shuffles_labels_and_scales_float_inputs():
    faults = (Fault(kind="bad_batch", rank=1, step=4),)
    x, y = torch.rand(8, 64), torch.arange(8)
    assert corrupt_batch(faults, 0, 4, x, y)[0] is x and corrupt_batch(faults, 1, 3, x, y)[1] is y
    bad_x, bad_y = corrupt_batch(faults, 1, 4, x, y)
    assert torch.equal(bad_x, x * BAD_INPUT_SCALE)
    assert sorted(bad_y.tolist()) == list(range(8)) and not torch.equal(bad_y, y)
    tokens = torch.arange(24).view(3, 8)
    same_tokens, shuffled = corrupt_batch(faults, 1, 4, tokens, tokens + 1)
    assert same_tokens is tokens and shuffled.shape == (3, 8) and not torch.equal(shuffled, tokens + 1)


def test_a_bad_batch_on_one_rank_reaches_every_rank_through_the_average(runs_root):
    cfg = RunConfig(task="digits", world_size=2, steps=5, optimizer="sgd", lr=0.1, tensorboard=False,
                    save_final=False, nan_policy="ignore", faults=(Fault(kind="bad_batch", rank=1, step=2),))
    losses = labkit.launch(cfg, runs_root=runs_root, echo=False).df.pivot(index="step", columns="rank",
                                                                          values="loss")
    assert losses.loc[2, 1] > 10 * losses.loc[1, 1] and losses.loc[2, 0] < 2 * losses.loc[1, 0]
    assert losses.loc[3, 0] > 10 * losses.loc[1, 0]                  # rank 0 never saw the batch, yet pays for it


def test_flag_cost_takes_turns_and_times_the_flags_parts(runs_root):
    run = labkit.launch(stability.flag_cost, config=CFG.replace(steps=10), runs_root=runs_root, echo=False)
    kinds = run.df[run.df["rank"] == 0].set_index("step")[["rows", "flag"]]
    rows = CFG.global_batch // CFG.world_size
    assert list(kinds.itertuples(index=False, name=None)) == [(rows * t, f) for t, f in map(stability.flag_kind,
                                                                                             range(10))]
    assert (run.df.loc[run.df["flag"] == 0, "flag_calls"] == 0).all()      # no agreement on unflagged steps
    summary = stability.flag_cost_summary(run)
    assert summary.index.tolist() == [rows, stability.GROWTH * rows] and (summary["pairs"] == 2).all()
    assert (summary["round_trip"] > 0).all() and (summary["most"] >= summary["least"]).all()


def test_clip_before_unscale_sees_the_norm_times_the_loss_scale(runs_root):
    cfg = CFG.replace(precision="fp16", grad_accum=2, clip_norm=1.0, steps=3)
    table = stability.clip_order_table(labkit.launch(stability.clip_orders, config=cfg, runs_root=runs_root,
                                                     echo=False))
    assert len(table) >= 1
    assert (table["seen / true"] / table["loss_scale"]).sub(1).abs().max() < 1e-3
    assert (table["left_before"] < 1e-3 * table["left_after"]).all()
    assert (table["left_after"] <= 1.0 + 1e-5).all()


def _records(**columns):
    df = pd.DataFrame(columns)
    return SimpleNamespace(df=df.assign(rank=0, step=range(len(df))))


def test_the_returned_norm_check_needs_steps_on_both_sides_of_the_max():
    before = _records(norm=[3.0, 7.0, 6.0], left=[3.0, 5.0, 5.0])
    assert stability.clip_returned_norm_before(before, 5.0)[1]
    assert not stability.clip_returned_norm_before(_records(norm=[3.0, 5.0, 5.0], left=[3.0, 5.0, 5.0]), 5.0)[1]
    assert not stability.clip_returned_norm_before(_records(norm=[3.0, 7.0], left=[3.0, 7.0]), 5.0)[1]  # no clip
    assert not stability.clip_returned_norm_before(_records(norm=[6.0, 7.0], left=[5.0, 5.0]), 5.0)[1]  # none below
    assert stability.clip_returned_norm_before(_records(norm=[3.0, 7.0, math.nan], left=[3.0, 5.0, math.nan]), 5.0)[1]


def test_skipped_steps_and_weights_match_read_what_each_rank_did():
    df = pd.DataFrame({"rank": [0, 1, 0, 1], "step": [0, 0, 1, 1], "skipped": [0, 0, 1, 0]})
    assert stability.skipped_steps(SimpleNamespace(df=df)) == {0: [1], 1: []}
    same = [torch.ones(2), torch.zeros(3)]
    results = {0: same, 1: [t.clone() for t in same]}
    run = SimpleNamespace(world_size=2, result=lambda r: results[r])
    assert stability.weights_match(run) == (0.0, True)
    results[1] = [torch.ones(2), torch.tensor([0.0, math.nan, 0.0])]
    assert not stability.weights_match(run)[1]
    results[0], results[1] = [torch.full((2,), math.inf)], [torch.full((2,), math.inf)]
    assert not stability.weights_match(run)[1]                     # equal, but not finite


def test_the_alone_and_stop_readers_say_what_the_failure_holds():
    waiting = SimpleNamespace(step=6, detail="waiting inside torch (graph.py:979), called at loop.py:146")
    alone = SimpleNamespace(reason="hung", rank=1, detail="in dist.barrier (nonfinite.py:120)", statuses=[waiting, None])
    assert stability.hung_in_barrier(alone, rank=1) == ("hung: rank 1, in barrier", True)
    assert not stability.hung_in_barrier(alone, rank=0)[1]
    assert not stability.hung_in_barrier(SimpleNamespace(reason="raised", rank=1, detail="barrier"), rank=1)[1]
    assert stability.waits_in_torch(alone, rank=0, step=6) == ("rank 0 at step 6: waiting inside torch", True)
    assert not stability.waits_in_torch(alone, rank=0, step=5)[1]
    stop = SimpleNamespace(rank=1, step=5, detail="rank 1 went non-finite first, at step 5: loss nan, first "
                           "non-finite gradient (in backward's order): transformer.ln_f.weight. Every rank stopped")
    assert stability.names_the_culprit(stop, rank=1, step=5) == ("rank 1, step 5, transformer.ln_f.weight", True)
    assert not stability.names_the_culprit(SimpleNamespace(rank=1, step=5, detail="loss nan"), rank=1, step=5)[1]
