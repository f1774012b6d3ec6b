"""Resume exactly, restart by itself: real gloo ranks killed from outside, resumed, restarted, compared bit for bit
with a run that was never stopped."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import labkit
from labkit import Fault, LaunchError, RankFailure, RunConfig, launch, load_run
from labkit.training.state.checkpoint import CheckpointError, find
from labkit.tricks.killrank import KillRank

# Dropout draws from each rank's torch generator every step: a resume that lost an RNG stream would not match.
CONFIG = RunConfig(world_size=2, steps=14, checkpoint_every=2, checkpoint_keep=2, dropout=0.1, tensorboard=False)
EXACT = ["loss", "grad_norm", "lr", "clip_coef", "samples", "loss_scale", "skipped_step"]  # not timings, not memory


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every test compares against."""
    return launch(CONFIG, runs_root=tmp_path_factory.mktemp("reference"), echo=False)


def assert_same_records(reference, run, first_step):
    """Every record `run` has is bitwise the reference's, on the deterministic fields, from first_step to the end."""
    ref, mine = reference.df.set_index(["step", "rank"]), run.df.set_index(["step", "rank"])
    assert mine.index.get_level_values("step").min() <= first_step
    assert sorted(mine.index) == [i for i in sorted(ref.index) if i[0] >= mine.index.get_level_values(0).min()]
    for column in EXACT:
        assert ref.loc[mine.index, column].tolist() == mine[column].tolist(), column


@pytest.mark.parametrize("kill_at", [3, 9, 13])  # not right after a save (every 2 steps: after 1, 3, ...)
def test_a_run_killed_mid_step_resumes_bit_for_bit(kill_at, reference, runs_root, no_leftovers):
    with KillRank(rank=1, at_steps=[kill_at], runs_root=runs_root) as killer:
        with pytest.raises(RankFailure) as info:
            launch(CONFIG, runs_root=runs_root, echo=False)
    failure = info.value
    assert (failure.rank, failure.reason) == (1, "signal") and "SIGKILL" in failure.detail, str(failure)
    assert failure.step >= kill_at and killer.kills[0]["last_recorded"] >= kill_at - 1
    killed = failure.run
    saved = find(killed.path)
    resumed = launch(CONFIG, resume_from=killed, runs_root=runs_root, echo=False)
    start = int(saved.name.split("_")[1]) + 1
    assert resumed.df["step"].min() == start and resumed.meta["resumed_from"] == str(saved)
    assert_same_records(reference, resumed, start)


def test_a_kill_half_way_through_a_save_leaves_the_previous_checkpoint(reference, runs_root, no_leftovers):
    config = CONFIG.replace(faults=(Fault(kind="kill_in_save", rank=0, step=7),))
    with pytest.raises(RankFailure) as info:
        launch(config, runs_root=runs_root, echo=False)
    assert (info.value.rank, info.value.reason) == (0, "signal") and "SIGKILL" in info.value.detail
    root = info.value.run.path / "checkpoints"
    partial = root / ".partial-step_000007"
    assert (partial / "state.pt.tmp").stat().st_size > 0 and not (partial / "manifest.json").exists()
    assert find(root) == root / "step_000005"
    resumed = launch(CONFIG, resume_from=info.value.run, runs_root=runs_root, echo=False)
    assert_same_records(reference, resumed, 6)


def test_ten_restarts_in_a_row_under_launch(reference, runs_root, no_leftovers):
    config = CONFIG.replace(checkpoint_every=1)
    with KillRank(rank=1, at_steps=range(2, 12), runs_root=runs_root) as killer:
        run = launch(config, runs_root=runs_root, echo=False, max_restarts=10)
    assert len(killer.kills) == 10 and run.finished
    attempts = run.attempts()
    assert attempts.index.tolist() == list(range(11))
    assert attempts["failure"].iloc[:10].str.contains("rank 1 was killed by a signal").all()
    assert sorted(p.name for p in (run.path / "attempts").iterdir()) == sorted(str(a) for a in range(10))
    assert_same_records(reference, run, 0)


def test_when_restarts_run_out_the_last_failure_is_raised(runs_root, no_leftovers):
    config = CONFIG.replace(steps=6, faults=(Fault(kind="raise", rank=0, step=4),))  # fails in every attempt
    with pytest.raises(RankFailure, match="injected failure on rank 0 at step 4"):
        launch(config, runs_root=runs_root, echo=False, max_restarts=2)
    run = load_run(next(runs_root.iterdir()))
    attempts = run.attempts()  # the restarts resumed after step 3 and failed at once: they recorded nothing
    assert attempts.index.tolist() == [0, 1, 2] and attempts["first_step"].iloc[0] == 0
    assert attempts["first_step"].iloc[1:].isna().all() and attempts["failure"].str.contains("rank 0 raised").all()
    assert sorted(p.name for p in (run.path / "attempts").iterdir()) == ["0", "1"] and run.meta["outcome"] == "failed"


def test_three_restarts_in_a_row_under_torchrun_elastic(tmp_path):
    # Three, not ten: each restart costs torchrun 4 to 6 s of process start-up here, and a restarted group's
    # rendezvous (what once failed with 'Connection refused', MEASURED.md) is exercised by every restart after the
    # first; test_resume's launcher test still restarts ten times, in under 4 s.
    # Steps to spare: a kill can land a step or two later than asked (the steps are shorter than the watcher's
    # reaction time), and every attempt must still have steps left to record after the last kill.
    config = RunConfig(task="digits", world_size=2, steps=20, checkpoint_every=1, tensorboard=False)
    # The reference saves no checkpoints (20 saves, each behind a barrier: about 1 s): checkpointing changes no
    # record (test_ten_restarts_in_a_row_under_launch compares a run saving every step with one saving every two).
    reference = launch(config.replace(checkpoint_every=0), runs_root=tmp_path / "reference", echo=False)
    config.save(tmp_path / "config.json")
    job = tmp_path / "job"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "3", "-m", "labkit", "run", str(tmp_path / "config.json"), "--run-dir", str(job), "--timeout", "60"]
    with KillRank(rank=1, at_steps=range(2, 5), run_dir=job) as killer:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(killer.kills) == 3
    run = load_run(job)
    assert run.attempts().index.tolist() == list(range(4))
    assert "Connection refused" not in done.stderr
    assert_same_records(reference, run, 0)


def test_dcp_checkpoints_resume_bit_for_bit(reference, runs_root, no_leftovers):
    config = CONFIG.replace(checkpoint_format="dcp", steps=8)
    first = launch(config, runs_root=runs_root, echo=False)
    assert (find(first.path) / "sharded" / ".metadata").exists()
    resumed = launch(CONFIG.replace(checkpoint_format="dcp"), resume_from=find(first.path).parent / "step_000005",
                     runs_root=runs_root, echo=False)
    assert_same_records(reference, resumed, 6)


def test_resuming_from_nothing_or_with_another_world_size_is_refused(reference, runs_root, no_leftovers):
    with pytest.raises(LaunchError, match="no complete checkpoint there"):
        launch(CONFIG, resume_from=runs_root, runs_root=runs_root, echo=False)
    with pytest.raises(RankFailure, match="was written by 2 ranks; this run has 1"):
        launch(CONFIG.replace(world_size=1), resume_from=reference, runs_root=runs_root, echo=False)
    assert issubclass(CheckpointError, RuntimeError) and labkit.launch is launch
    changed = launch(CONFIG.replace(lr=0.01, steps=CONFIG.steps + 1), resume_from=reference, runs_root=runs_root,
                     echo=False)
    assert "differs from the one that wrote step_000013: lr 0.003 -> 0.01" in changed.log(0)
    assert changed.df["step"].tolist() == [CONFIG.steps, CONFIG.steps]


def test_gradscaler_and_plateau_state_resume_bit_for_bit(runs_root, no_leftovers):
    config = RunConfig(world_size=2, steps=11, checkpoint_every=4, checkpoint_keep=4, precision="fp16",
                       schedule="plateau", eval_every=1, plateau_patience=0, lr=0.1, tensorboard=False)
    first = launch(config, runs_root=runs_root, echo=False)
    resumed = launch(config, resume_from=first.path / "checkpoints" / "step_000007", runs_root=runs_root, echo=False)
    at_resume = first.df[first.df["step"] == 8].iloc[0]
    # Both pieces of state had moved away from their starting values by then: restoring them is what is tested.
    assert at_resume["lr"] < config.lr and at_resume["loss_scale"] < first.df["loss_scale"].iloc[0]
    assert_same_records(first, resumed, 8)
    ref, mine = first.df.set_index(["step", "rank"]), resumed.df.set_index(["step", "rank"])
    assert ref.loc[mine.index, "eval_loss"].tolist() == mine["eval_loss"].tolist()


@pytest.mark.parametrize("strategy", ["zero1", "fsdp", "tp"])
def test_sharded_strategies_resume_bit_for_bit(strategy, runs_root, no_leftovers):
    """zero1 saves the optimizer gathered on rank 0 ("full"); fsdp and tp go through DCP, each rank its shard."""
    import labkit
    cfg = RunConfig(world_size=2, steps=6, strategy=strategy, checkpoint_every=2, global_batch=16,
                    tensorboard=False, save_final=False)
    whole = labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False)
    with pytest.raises(labkit.RankFailure) as crash:
        labkit.launch(cfg.replace(faults=(labkit.Fault(kind="exit", rank=1, step=4),)), runs_root=runs_root,
                      echo=False, progress=False)
    resumed = labkit.launch(cfg, resume_from=crash.value.run, runs_root=runs_root, echo=False, progress=False)
    a, b = (run.steps().set_index("step")["loss"] for run in (whole, resumed))
    assert b.index.min() > 0 and list(b.index) == list(range(b.index.min(), 6))
    assert (a[b.index] == b).all(), (a, b)
