"""Lesson 13's claims, each broken on purpose through the labkit function the lesson asserts with: the failure
report's consequences, a broken resume that still learns (loss_slope), and the step after a save paying for it
(save_costs' paid_by_next_step)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit import RunConfig
from labkit.records import Run, write_meta
from labkit.run.failure import RankFailure, RankStatus
from labkit.training.state.checkpoint import SAVES_LOG, checkpoints_dir
from labkit.tricks import recovery


def _report(rank0: RankStatus) -> RankFailure:
    cause = RankStatus(rank=1, state="signal", step=14, recorded=13, detail="SIGKILL")
    return RankFailure(cause, [rank0, cause], Path("/nonexistent"))


def test_rank_0_is_a_consequence_only_when_the_report_ties_it_to_the_killed_rank():
    assert _report(RankStatus(0, "raised", 14, 13, "gloo: Connection closed by peer", because_of=1)).consequences == [0]
    assert _report(RankStatus(0, "stopped", 14, 13)).consequences == [0]
    # Broken on purpose: rank 0 failed on its own (or its line blames no one): not listed as a consequence.
    assert _report(RankStatus(0, "raised", 14, 13, "ValueError: bad batch")).consequences == []
    assert _report(RankStatus(0, "raised", 14, 13, "lost peer", because_of=2)).consequences == []


def _fake_run(path: Path, losses: list[float], step_s: list[float] | None = None, saves: list[dict] | None = None,
              checkpoint_every: int = 2) -> Run:
    path.mkdir(parents=True)
    write_meta(path, name=path.name, world_size=1)
    RunConfig(world_size=1, steps=len(losses), checkpoint_every=checkpoint_every).save(path / "config.json")
    step_s = step_s or [0.1] * len(losses)
    (path / "rank0.jsonl").write_text("".join(json.dumps({"rank": 0, "step": s, "time": 100.0 + s, "loss": loss,
                                                           "lr": 0.1, "samples": 4, "tokens": 0, "t_step": t}) + "\n"
                                              for s, (loss, t) in enumerate(zip(losses, step_s))))
    if saves is not None:
        checkpoints_dir(path).mkdir()
        (checkpoints_dir(path) / SAVES_LOG).write_text("".join(json.dumps(s) + "\n" for s in saves))
    return Run(path)


def test_loss_slope_is_negative_while_learning_and_catches_a_run_that_no_longer_learns(tmp_path):
    falling = _fake_run(tmp_path / "falling", [3.0 - 0.05 * s + 0.01 * (s % 2) for s in range(24)])
    assert recovery.loss_slope(falling, first_step=12) < 0
    stalled = _fake_run(tmp_path / "stalled", [3.0] * 12 + [2.4 + 0.01 * s for s in range(12)])   # broken on purpose
    assert recovery.loss_slope(stalled, first_step=12) > 0       # the lesson's `(slopes < 0).all()` would fail
    with pytest.raises(ValueError, match="a slope needs 2"):
        recovery.loss_slope(falling, first_step=23)


def test_paid_by_next_step_is_about_one_save_and_falls_when_the_save_is_not_paid_by_the_loop(tmp_path):
    # A save after every second step (after steps 1, 3, ...) of 50 ms; the step after it is 50 ms longer.
    steps = [0.10 + (0.05 if s % 2 == 0 and s > 0 else 0.0) for s in range(12)]
    saves = [{"step": s, "seconds": 0.05, "bytes": 1000} for s in range(1, 12, 2)]
    paid = recovery.save_costs(_fake_run(tmp_path / "paid", [1.0] * 12, steps, saves))
    assert paid["saves"] == 6 and paid["paid_by_next_step"] == pytest.approx(1.0)
    # Broken on purpose: the steps after a save are no longer than the others (the save happened elsewhere).
    unpaid = recovery.save_costs(_fake_run(tmp_path / "unpaid", [1.0] * 12, [0.1] * 12, saves))
    assert not 0.5 <= unpaid["paid_by_next_step"] <= 2.0         # the lesson's gated check would fail


def test_exact_resume_counts_differing_records_and_missing_steps(tmp_path):
    losses = [2.0 - 0.1 * s for s in range(8)]
    reference = _fake_run(tmp_path / "reference", losses)
    exact = _fake_run(tmp_path / "exact", losses)       # steps 0-7; compared from step 4 on below
    differ, same_rows = recovery.exact_resume(reference, exact, ["loss", "lr"], first=0)
    assert differ == {"loss": 0, "lr": 0} and same_rows
    # Broken on purpose: one loss off by one ulp is counted; a resume that starts late is not the same records.
    off = _fake_run(tmp_path / "off", losses[:5] + [losses[5] + 1e-15] + losses[6:])
    assert recovery.exact_resume(reference, off, ["loss"], first=0)[0] == {"loss": 1}
    assert recovery.exact_resume(reference, exact, ["loss"], first=4)[1] is False    # steps 0-3 too many
