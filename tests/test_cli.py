"""The same training loop under torchrun, one process per rank, writing the same records."""
import os
import subprocess
import sys

from labkit import RunConfig, load_run


def test_torchrun_runs_the_loop_and_records_every_rank(tmp_path):
    config = tmp_path / "config.json"
    RunConfig(world_size=2, steps=4, tensorboard=False).save(config)
    run_dir = tmp_path / "job"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "labkit", "run", str(config), "--run-dir", str(run_dir), "--timeout", "60"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    run = load_run(run_dir)
    assert sorted(run.df["rank"].unique()) == [0, 1] and run.steps()["step"].tolist() == [0, 1, 2, 3]
    summary = subprocess.run([sys.executable, "-m", "labkit", "summary", str(run_dir)], capture_output=True,
                             text=True, timeout=60)
    assert '"steps": 4' in summary.stdout

