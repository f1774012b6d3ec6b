"""Lessons 09-12's claims, broken on purpose: each test makes the measured fact false in the ranks (or feeds the
lesson's labkit function a case where it must not hold) and sees the lesson's check fail, through the same labkit
functions the lesson calls; and the references those checks compare with, checked by hand."""
import json
import math

import pandas as pd
import pytest
import torch

import labkit
import labkit.training.loop as loop_module
import labkit.training.lr as lr_module
from labkit import Fault, RankFailure, RunConfig
from labkit.measure import checked_unless, claims
from labkit.training import nonfinite as nonfinite_module
from labkit.tricks import debugtools, hangs, monitor, schedules, stability

SMALL = RunConfig(world_size=2, global_batch=16, steps=8, tensorboard=False, save_final=False)


def launch(cfg, runs_root, **kw):
    return labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False, **kw)


# --- lesson 09 -----------------------------------------------------------------------------------------------

def test_a_rank_left_alone_that_then_fails_breaks_lesson_09s_nobody_failed_check(runs_root, monkeypatch):
    def fails_instead(self):
        if self.left:
            raise RuntimeError("this rank gave up instead of waiting")
    monkeypatch.setattr(nonfinite_module.NanGuard, "wait_for_peers", fails_instead)
    cfg = SMALL.replace(nan_policy="alone", faults=(Fault(kind="nan", rank=1, step=2),))
    with pytest.raises(RankFailure) as info:
        launch(cfg, runs_root, timeout=3.0)
    assert not stability.everyone_waited(info.value)   # lesson 09's "alone" check


def test_a_stop_that_still_takes_the_step_breaks_lesson_09s_check(runs_root, monkeypatch):
    original = loop_module.optimizer_step
    monkeypatch.setattr(loop_module, "optimizer_step", lambda *a, take=True, **k: original(*a, take=True, **k))
    cfg = SMALL.replace(nan_policy="stop", faults=(Fault(kind="nan", rank=1, step=2),))
    with pytest.raises(RankFailure) as info:
        launch(cfg, runs_root, timeout=10.0)
    assert not stability.stopped_together(info.value.run, 2)   # lesson 09's "stop" check


def test_a_flag_sent_in_float64_breaks_lesson_09s_byte_count(runs_root, monkeypatch):
    original = nonfinite_module.NanGuard.__init__

    def in_float64(self, *a, **k):
        original(self, *a, **k)
        self._flag = self._flag.double()
    monkeypatch.setattr(nonfinite_module.NanGuard, "__init__", in_float64)
    cost = stability.flag_traffic(labkit.launch(stability.flag_cost, config=SMALL, runs_root=runs_root,
                                                echo=False, progress=False))
    assert (cost["flag_calls"], cost["flag_bytes"], cost["bytes_unflagged"]) == (1, 16, 0)   # counted, not assumed
    assert (cost["flag_calls"], cost["flag_bytes"], cost["bytes_unflagged"]) != (1, 4 * SMALL.world_size, 0)


def test_lesson_09s_price_per_step_check_fails_on_a_price_per_sample():
    """The claim's check on tables flag_cost_summary could return: a flag whose milliseconds grew with the rows as
    fast as the step did (a price per sample) fails it, as does a larger batch whose step was not longer."""
    per_step = pd.DataFrame({"step": [25.0, 80.0], "share": [12.0, 4.5]}, index=pd.Index([16, 64], name="rows"))
    assert stability.flag_share_falls(per_step) and stability.flag_share_falls(per_step.iloc[::-1])
    assert not stability.flag_share_falls(per_step.assign(share=[12.0, 12.0]))   # the flag grew with the batch
    assert not stability.flag_share_falls(per_step.assign(step=[25.0, 25.0]))    # the step did not
    assert [stability.flag_kind(s) for s in range(8)] == [(1, 0), (1, 1), (4, 0), (4, 1), (4, 1), (4, 0), (1, 1),
                                                          (1, 0)]


def test_lesson_09s_below_the_max_check_fails_when_no_step_was_below(runs_root):
    tiny_max = 1e-4
    cfg = SMALL.replace(precision="fp16", grad_accum=2, clip_norm=tiny_max, steps=3)
    table = stability.clip_order_table(labkit.launch(stability.clip_orders, config=cfg, runs_root=runs_root,
                                                     echo=False, progress=False))
    below = table[table["grad_norm"] < tiny_max]
    assert len(table) >= 1 and not (len(below) >= 1 and (below["left_after"] == below["grad_norm"]).all())


def test_a_loop_that_clips_before_unscaling_breaks_lesson_09s_loop_check(runs_root, monkeypatch):
    original = loop_module.optimizer_step

    def clips_first(model, optimizer, scaler, clip_norm, *, take=True):
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip_norm).item()   # on the scaled gradients
        original(model, optimizer, scaler, None, take=take)
        return {"grad_norm": norm, "clip_coef": min(1.0, clip_norm / norm)}
    cfg = SMALL.replace(precision="fp16", grad_accum=2, clip_norm=1.5, steps=3)
    table = stability.clip_order_table(labkit.launch(stability.clip_orders, config=cfg, runs_root=runs_root,
                                                     echo=False, progress=False))
    honest = stability.clipping(launch(cfg, runs_root)).loc[table.index]
    assert ((honest["grad_norm"] / table["grad_norm"]) - 1).abs().max() < 1e-5   # lesson 09: the loop's order
    monkeypatch.setattr(loop_module, "optimizer_step", clips_first)
    broken = stability.clipping(launch(cfg, runs_root)).loc[table.index]
    assert not ((broken["grad_norm"] / table["grad_norm"]) - 1).abs().max() < 1e-5


def _hand_loop(ctx, agree=True, norm_after=False):
    """Lesson 09's fn(ctx): DDP, rank 1's batch holds an inf at step 3, clip_grad_norm_ at 5.0, then each rank's
    verdict on its own loss, all-reduced (unless `agree` is False: each rank goes by its own loss only)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + ctx.rank)
    for step in range(6):
        x = torch.randn(16, 8, generator=data)
        if ctx.rank == 1 and step == 3:
            x[0] = math.inf
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        left = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        flag = torch.zeros(ctx.world_size)
        flag[ctx.rank] = float(not math.isfinite(loss.item()))
        if agree:
            torch.distributed.all_reduce(flag)
        skip = bool(flag.any()) or (agree and not math.isfinite(norm.item()))
        if not skip:
            opt.step()
        ctx.record(step, loss=loss.item(), norm=(left if norm_after else norm).item(), left=left.item(),
                   skipped=int(skip))
    return [p.detach().clone() for p in model.parameters()]


def _each_rank_by_its_own_loss(ctx):
    return _hand_loop(ctx, agree=False)


def _norm_read_after_clipping(ctx):
    return _hand_loop(ctx, norm_after=True)


def test_lesson_09s_hand_written_loop_holds_its_claims(runs_root):
    run = labkit.launch(_hand_loop, world_size=2, runs_root=runs_root, echo=False, progress=False)
    assert stability.skipped_steps(run) == {0: [3], 1: [3]}
    assert stability.clip_returned_norm_before(run, 5.0)[1] and stability.weights_match(run)[1]


def test_a_flag_that_is_not_all_reduced_breaks_lesson_09s_skip_together_and_weights_checks(runs_root):
    run = labkit.launch(_each_rank_by_its_own_loss, world_size=2, runs_root=runs_root, echo=False, progress=False)
    skipped = stability.skipped_steps(run)
    assert 3 in skipped[1] and 3 not in skipped[0]               # rank 0's loss was finite: it took the NaN step
    assert skipped != {0: [3], 1: [3]}                           # lesson 09's check
    gap, same = stability.weights_match(run)
    assert not same                                              # rank 0's weights went NaN, rank 1's did not


def test_a_norm_read_after_clipping_breaks_lesson_09s_returned_norm_check(runs_root):
    run = labkit.launch(_norm_read_after_clipping, world_size=2, runs_root=runs_root, echo=False, progress=False)
    said, ok = stability.clip_returned_norm_before(run, 5.0)
    assert not ok and said.startswith("0 of ")


# --- lesson 10 -----------------------------------------------------------------------------------------------

def test_torch_lrs_gives_the_values_worked_by_hand_with_labkits_conventions():
    # warmup 2 of 11 steps to a peak of 1: step 0 trains at 1/2, step 1 at 1; the decay runs over steps 2..10
    # (8 intervals) and ends on the last step: half-way (step 6) cosine and linear are both at the midpoint.
    cosine = schedules.torch_lrs(RunConfig(lr=1.0, steps=11, warmup_steps=2, schedule="cosine"))
    assert cosine[:3] == pytest.approx([0.5, 1.0, 1.0]) and cosine[6] == pytest.approx(0.5)
    assert cosine[10] == pytest.approx(0.0, abs=1e-15)
    assert cosine[4] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    linear = schedules.torch_lrs(RunConfig(lr=2.0, steps=11, warmup_steps=2, schedule="linear", min_lr_ratio=0.1))
    assert linear[0] == pytest.approx(1.0) and linear[6] == pytest.approx(1.1) and linear[10] == pytest.approx(0.2)
    assert schedules.torch_lrs(RunConfig(lr=3.0, steps=5, warmup_steps=4)) == pytest.approx([0.75, 1.5, 2.25, 3, 3])


def test_a_warmup_that_starts_at_zero_breaks_lesson_10s_lr_check(runs_root, monkeypatch):
    cfg = SMALL.replace(steps=10, warmup_steps=4, schedule="cosine", lr=0.01)
    good = launch(cfg, runs_root)
    assert schedules.lr_mismatch(good, schedules.torch_lrs(cfg)) < schedules.LR_TOLERANCE
    original = lr_module.lr_at

    def from_zero(step, **kw):
        return kw["peak"] * step / kw["warmup_steps"] if step < kw.get("warmup_steps", 0) else original(step, **kw)
    monkeypatch.setattr(lr_module, "lr_at", from_zero)
    broken = launch(cfg, runs_root)
    assert not schedules.lr_mismatch(broken, schedules.torch_lrs(cfg)) < schedules.LR_TOLERANCE


def test_two_cycles_are_not_plain_cosine_and_one_cycle_is(runs_root):
    cfg = SMALL.replace(steps=12, warmup_steps=2, schedule="cosine_restarts")
    one, two = launch(cfg.replace(cycles=1), runs_root), launch(cfg.replace(cycles=2), runs_root)
    assert schedules.lr_mismatch(one, schedules.cosine_with_warmup_lrs(one.config)) < schedules.LR_TOLERANCE
    assert not schedules.lr_mismatch(two, schedules.cosine_with_warmup_lrs(two.config)) < schedules.LR_TOLERANCE
    # lesson 10's "one run through the warmup" check: the same LRs up to there, then not
    assert schedules.loss_gap(one, two, until=cfg.warmup_steps) == 0.0 and schedules.loss_gap(one, two, 11) > 0


def test_expected_restarts_are_where_the_cycles_cross_by_hand():
    # 20 decay steps after a warmup of 2, two cycles: the second cycle starts 10 steps in, at step 12
    assert schedules.expected_restarts(RunConfig(lr=1.0, steps=22, warmup_steps=2, schedule="cosine_restarts",
                                                 cycles=2)) == [12]
    # lesson 10's runs: 80 decay steps, three cycles, crossings at 26.7 and 53.3 steps in
    assert schedules.expected_restarts(RunConfig(lr=1.0, steps=90, warmup_steps=10, schedule="cosine_restarts",
                                                 cycles=3)) == [37, 64]
    assert schedules.expected_restarts(RunConfig(lr=1.0, steps=22, warmup_steps=2, schedule="cosine_restarts",
                                                 cycles=1)) == []


def record_lrs(ctx):
    lrs = [0.1, 0.2, 0.3, 0.3, 0.15, 0.15, 0.075 if ctx.rank == 0 else 0.3]
    for step, lr in enumerate(lrs):
        ctx.record(step, lr=lr)


def test_cut_steps_and_first_step_at_read_the_records_by_hand(runs_root):
    run = labkit.launch(record_lrs, world_size=2, runs_root=runs_root, echo=False, progress=False)
    assert schedules.cut_steps(run) == [4, 6]                  # rank 0's LR went down at steps 4 and 6
    assert schedules.first_step_at(run, 0.3) == 2              # both ranks at 0.3 first at step 2
    assert schedules.first_step_at(run, 0.075) is None         # only rank 0 ever trained at 0.075
    assert run.lr_disagreement() == 6


def warmup_then_record(ctx, per_micro=False, accum=4, warmup=5):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup)
    for step in range(8):
        ctx.record(step, lr=opt.param_groups[0]["lr"])
        for _ in range(accum if per_micro else 1):
            opt.step()
            ramp.step()


def test_a_scheduler_stepped_per_micro_batch_breaks_lesson_10s_warmup_check(runs_root):
    good = labkit.launch(warmup_then_record, world_size=2, runs_root=runs_root, echo=False, progress=False)
    assert schedules.first_step_at(good, 0.1) == 5             # the lesson's check: peak at step WARMUP
    broken = labkit.launch(lambda ctx: warmup_then_record(ctx, per_micro=True), world_size=2, runs_root=runs_root,
                           echo=False, progress=False)
    assert schedules.first_step_at(broken, 0.1) == 2           # four scheduler steps per optimizer step


def test_a_restart_compared_with_itself_raises_nothing(runs_root):
    hard = launch(SMALL.replace(steps=24, warmup_steps=2, schedule="cosine_restarts", cycles=2), runs_root)
    rises = schedules.restart_rises(hard, hard)
    assert len(rises) == 1 and not all(r > 0 for r in rises)   # lesson 10's check needs a rise over plain cosine


# --- lesson 11 -----------------------------------------------------------------------------------------------

def test_a_rank_whose_clock_is_ahead_is_found_from_its_events(runs_root):
    run = launch(SMALL.replace(tensorboard=True, faults=(Fault(kind="clock", rank=1, step=0, delay_s=1.5),)),
                 runs_root)
    table = monitor.read_tensorboard(run)
    assert monitor.clock_is_off(table, 1, 1.5)                                 # lesson 11's check, recovered
    assert run.df.groupby("rank")["time"].max().diff().iloc[1] > 1.0          # rank 1's records, written ahead
    unskewed = table.assign(wall_time=table["wall_time"] - 1.5 * (table["rank"] == 1))   # events without the skew
    assert not monitor.clock_is_off(unskewed, 1, 1.5)                          # a skew not recovered fails it
    assert monitor.clock_is_off(unskewed, 1, 0.0, scale=1.5)                   # (and reads as one clock)
    assert not monitor.clock_is_off(table, 1, 1.5 * 1.2)                       # recovered 20% short fails it too
    with pytest.raises(labkit.ConfigError, match="seconds the clock is ahead"):
        RunConfig(faults=(Fault(kind="clock", rank=0, step=0),))


def test_a_run_that_computes_something_else_breaks_lesson_11s_same_loss_check(runs_root):
    a, b = launch(SMALL, runs_root), launch(SMALL.replace(seed=1), runs_root)
    assert not monitor.same_losses(a, b)                                       # another seed: other losses
    assert monitor.loss_gap(a, a.df[a.df["step"] < 5]) == float("inf")        # fewer steps: not the same run
    assert not monitor.same_losses(a, a.df[a.df["step"] < 5]) and monitor.same_losses(a, a.df)


# --- lesson 12 -----------------------------------------------------------------------------------------------

def test_the_collectives_figure_draws_each_rank_and_marks_the_odd_one(runs_root):
    out = hangs.reproduce("order", timeout=2.0, debug=hangs.Debug(flight_recorder=True), runs_root=runs_root)
    fig = debugtools.collectives_figure({"order": debugtools.flight_records(out.run)})
    labels = {t.get_text(): t.get_color() for t in fig.axes[0].get_yticklabels()}
    assert labels == {"rank 0": "black", "rank 1  (odd one out)": "red", "rank 2": "black"}


def test_hangs_timed_measures_on_metered_cores_and_again(runs_root):
    timed = hangs.timed(("lock",), cores=1, timeout=4.0, debug=hangs.Debug(barrier_s=1.0), runs_root=runs_root)
    assert timed.outcomes["lock"].failure.rank == 0 and timed.others >= 0
    assert list(timed.again().outcomes) == ["lock"]


def test_a_claim_some_machines_cannot_check_is_counted(tmp_path, monkeypatch):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv(claims.LOG_ENV, str(log))
    assert checked_unless("ptrace refused", "py-spy", lambda m: None).status == "skipped"
    assert checked_unless(None, "py-spy", lambda m: None).status == "checked"
    with pytest.raises(AssertionError):
        checked_unless(None, "py-spy", lambda m: (_ for _ in ()).throw(AssertionError("no")))
    statuses = [json.loads(line)["status"] for line in log.read_text().splitlines()]
    assert statuses == ["skipped", "checked", "failed"]
    assert claims.summary_lines(claims.read_log(log))[0] == "gated claims: 1 checked, 1 skipped, 1 failed"
