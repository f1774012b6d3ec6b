"""Real gloo ranks: launching, failure reports, cleanup, records, equivalence of DDP with one process."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import traceback
import time

import pytest
import torch

import labkit
from labkit import ConfigError, Fault, LaunchError, RankFailure, RunConfig, launch

from .conftest import leftover_processes

launch_module = importlib.import_module("labkit.run.launch")  # the module; labkit.launch is the function
cuda_guard = importlib.import_module("labkit.run.cuda_guard")

# A function as a notebook cell defines it: its module is __main__, so it cannot be imported by name.
CELL = textwrap.dedent("""
    import torch, torch.distributed as dist
    def cell_worker(ctx):
        x = torch.ones(4) * (ctx.rank + 1)
        for step in range(3):
            dist.all_reduce(x)
            ctx.record(step, value=x[0].item())
        print("rank", ctx.rank, "done")
        return {"rank": ctx.rank, "sum": x.sum().item()}
""")


def _cell_function():
    namespace = {"__name__": "__main__"}
    exec(compile(CELL, "<notebook cell>", "exec"), namespace)
    return namespace["cell_worker"]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_function_defined_in_a_cell_runs_on_every_rank(method, runs_root, no_leftovers):
    run = launch(_cell_function(), world_size=2, start_method=method, runs_root=runs_root, timeout=30)
    assert [run.result(r) for r in range(2)] == [{"rank": 0, "sum": 48.0}, {"rank": 1, "sum": 48.0}]
    assert run.df.groupby("rank")["step"].apply(list).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert "rank 1 done" in run.log(1)


FAULTS = [("raise", "raised", "InjectedFault"), ("segfault", "signal", "SIGSEGV"), ("hang", "hung", "inject.py"),
          ("exit", "exited", "exit code 3"), ("nan", "raised", "NonFiniteLoss")]


@pytest.mark.parametrize("kind, reason, detail", FAULTS)
def test_a_failing_rank_is_named_with_its_step_quickly_and_nothing_is_left(kind, reason, detail, runs_root,
                                                                           no_leftovers):
    timeout = 3.0
    cfg = RunConfig(world_size=2, steps=8, tensorboard=False, faults=(Fault(kind=kind, rank=1, step=4),))
    launch(RunConfig(world_size=1, steps=1, tensorboard=False), runs_root=runs_root)  # pay one-off imports first
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(cfg, runs_root=runs_root, timeout=timeout, echo=False)
    elapsed = time.monotonic() - started
    failure = info.value
    assert (failure.rank, failure.step, failure.reason) == (1, 4, reason), str(failure)
    assert detail in failure.detail + failure.traceback, str(failure)
    assert elapsed < timeout + 5
    assert not leftover_processes()


def test_a_hung_rank_is_told_apart_from_the_rank_waiting_for_it(runs_root, no_leftovers):
    def worker(ctx):
        x = torch.ones(2)
        for step in range(5):
            ctx.heartbeat(step)
            if ctx.rank == 0 and step == 2:
                time.sleep(60)  # rank 0 stuck in its own code; rank 1 waits in the all_reduce
            torch.distributed.all_reduce(x)
            ctx.record(step)
    with pytest.raises(RankFailure) as info:
        launch(worker, world_size=2, runs_root=runs_root, timeout=2, echo=False)
    failure = info.value
    assert (failure.rank, failure.step, failure.reason) == (0, 2, "hung")
    assert "time.sleep" in failure.traceback or "in worker" in failure.traceback
    waiting = [s for s in failure.statuses if s.rank == 1][0]
    assert waiting.state == "waiting" and "all_reduce" in waiting.detail


def test_records_before_a_crash_are_complete(runs_root, no_leftovers):
    cfg = RunConfig(world_size=2, steps=10, faults=(Fault(kind="raise", rank=1, step=6),))
    with pytest.raises(RankFailure) as info:
        launch(cfg, runs_root=runs_root, echo=False)
    run = info.value.run
    for rank in range(2):
        lines = (run.path / f"rank{rank}.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines]  # every line is whole JSON
        assert steps[:6] == list(range(6))
    error = json.loads((run.path / "rank1.error.json").read_text())
    assert error["step"] == 6 and "InjectedFault" in error["traceback"]


def test_bad_input_is_rejected_before_any_process_starts(runs_root, no_leftovers):
    with pytest.raises(ConfigError):
        launch(RunConfig(world_size=3, global_batch=32), runs_root=runs_root)
    with pytest.raises(LaunchError, match="world_size = 0"):
        launch(_cell_function(), world_size=0, runs_root=runs_root)
    with pytest.raises(LaunchError, match="config.world_size = 2"):
        launch(labkit.train, world_size=1, config=RunConfig(world_size=2), runs_root=runs_root)
    with pytest.raises(LaunchError, match="start_method"):
        launch(_cell_function(), world_size=1, start_method="forkserver", runs_root=runs_root)
    assert not runs_root.exists() or not any(runs_root.iterdir())


def test_fork_is_refused_and_auto_uses_the_warm_process_when_cuda_is_initialised(monkeypatch, runs_root,
                                                                                 no_leftovers):
    monkeypatch.setattr(cuda_guard, "cuda_is_initialised", lambda: True)
    monkeypatch.setattr(cuda_guard, "_cuda_initialised_before_labkit", False)
    monkeypatch.setattr(cuda_guard, "_cuda_init_stack", [traceback.FrameSummary("my_cell.py", 3, "<module>")])
    with pytest.raises(LaunchError, match="my_cell.py"):
        launch(_cell_function(), world_size=1, start_method="fork", runs_root=runs_root)
    assert launch_module.choose_start_method("auto") == "warm"  # tests/test_warm.py launches it
    monkeypatch.setenv("LABKIT_PREWARM", "0")  # no warm process wanted: spawn, as before
    assert launch_module.choose_start_method("auto") == "spawn"


def test_two_launches_at_the_same_time_do_not_collide(tmp_path, no_leftovers):
    # digits, not the default tinylm: each launching interpreter would import transformers' GPT-2 before forking
    # (about 4 s of CPU each); what may collide (run directories, ports, the ranks' stores) is the same for any task.
    script = textwrap.dedent(f"""
        import labkit, sys
        run = labkit.launch(labkit.RunConfig(task="digits", world_size=2, steps=5, tensorboard=False),
                            runs_root=sys.argv[1], echo=False)
        print(run.path)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"r{i}")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    runs = [labkit.load_run(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(len(r.df) == 10 for r in runs)


def test_ddp_two_ranks_match_one_rank_with_the_combined_batch(runs_root, no_leftovers):
    cfg = RunConfig(world_size=1, global_batch=16, steps=6, optimizer="sgd", lr=0.05, tensorboard=False)
    one = launch(cfg, runs_root=runs_root)
    two = launch(cfg.replace(world_size=2), runs_root=runs_root)
    final = [two.final_state(r) for r in range(2)]
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name  # DDP keeps the ranks bitwise equal
        assert torch.allclose(value, one.final_state(0)[name], atol=1e-5), name
    assert two.steps()["loss"].tolist() == pytest.approx(one.steps()["loss"].tolist(), abs=1e-5)
    summary = two.summary()
    assert summary["steps"] == 6 and summary["median_samples_per_s"] > 0 and summary["time_to_first_step_s"] > 0


def test_train_records_the_promised_fields(runs_root, no_leftovers):
    run = launch(RunConfig(task="digits", world_size=2, steps=4, eval_every=2, clip_norm=1.0), runs_root=runs_root)
    record = run.df.iloc[-1]
    for field in ("loss", "lr", "grad_norm", "samples", "tokens", "t_data", "t_fwd_bwd", "t_optim",
                  "t_step", "rss_mb", "accuracy", "eval_accuracy", "time"):
        assert field in run.df and record[field] == record[field], field  # present and not NaN
    assert (run.path / "tb" / "rank1").is_dir() and any((run.path / "tb" / "rank1").iterdir())


def test_the_cuda_tracker_names_the_call_that_initialised_cuda(monkeypatch):
    state = {"initialised": False}
    monkeypatch.setattr(cuda_guard, "_cuda_init_stack", None)
    monkeypatch.setattr(cuda_guard, "_cuda_initialised_before_labkit", False)
    monkeypatch.setattr(cuda_guard, "cuda_is_initialised", lambda: state["initialised"])

    def failing_init():
        raise AssertionError("Torch not compiled with CUDA enabled")
    with pytest.raises(AssertionError):
        cuda_guard.tracking(failing_init, lambda: False)()
    assert cuda_guard._cuda_init_stack is None  # a failed initialisation is not remembered

    wrapper = cuda_guard.tracking(lambda: state.update(initialised=True), lambda: state["initialised"])

    def user_cell_touching_cuda():
        wrapper()
    user_cell_touching_cuda()
    assert "user_cell_touching_cuda" in cuda_guard.cuda_init_culprit()


def test_ranks_stuck_after_their_work_are_reported_not_waited_for(monkeypatch, runs_root, no_leftovers):
    from labkit.run import rank as rank_module

    def stuck_teardown(store, spec):
        time.sleep(60)  # e.g. a destroy_process_group that never returns
    monkeypatch.setattr(rank_module, "_finish", stuck_teardown)  # forked ranks inherit the patch
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_cell_function(), world_size=2, start_method="fork", timeout=2, runs_root=runs_root, echo=False)
    assert time.monotonic() - started < 2 + 5
    assert all(s.state in ("waiting", "hung") for s in info.value.statuses)
    assert "finished" in str(info.value)


def test_the_training_loop_gets_the_startup_timeout_until_its_first_step_and_a_function_does_not():
    """A rank forked from the warm process is RUNNING before the loop has built its task (imports, data): until the
    loop's first step it is still setting up, and only the startup timeout applies to it."""
    import multiprocessing
    import time
    from labkit.run.launch import _is_stale
    from labkit.run.rank import RUNNING, Heartbeats
    beats = Heartbeats.create(multiprocessing.get_context("fork"), 1)
    beats.beat(0, state=RUNNING)
    beats.array[0] = time.time() - 10          # ten seconds since the last beat, still at step -1
    assert not _is_stale(beats, 0, timeout=3, startup_timeout=60, loop=True)
    assert _is_stale(beats, 0, timeout=3, startup_timeout=60, loop=False)    # fn(ctx): its own business
    beats.beat(0, step=0)
    beats.array[0] = time.time() - 10
    assert _is_stale(beats, 0, timeout=3, startup_timeout=60, loop=True)     # stepping: the timeout applies
