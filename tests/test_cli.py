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



def test_show_and_compare_read_run_directories(tmp_path):
    import pytest

    import labkit
    from labkit import Fault, RankFailure
    ok = labkit.launch(RunConfig(world_size=2, steps=3, tensorboard=False), runs_root=tmp_path, echo=False)
    with pytest.raises(RankFailure):
        labkit.launch(RunConfig(world_size=2, steps=5, tensorboard=False, faults=(Fault(kind="raise", rank=1, step=2),)),
                      runs_root=tmp_path, echo=False)
    failed = next(p for p in tmp_path.iterdir() if p != ok.path)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "labkit", *map(str, args)], capture_output=True, text=True,
                              timeout=120)
    shown = cli("show", ok.path)
    assert shown.returncode == 0 and "finished: every rank ended cleanly" in shown.stdout and "final_loss" in shown.stdout
    shown = cli("show", failed)
    assert "rank 1 raised at step 2" in shown.stdout and "InjectedFault" in shown.stdout, shown.stdout
    figure = tmp_path / "ab.png"
    drawn = cli("compare", ok.path, failed, "-o", figure, "--smooth", "2")
    assert drawn.returncode == 0 and figure.read_bytes()[:4] == b"\x89PNG", drawn.stderr
    missing = cli("show", tmp_path / "nope")
    assert missing.returncode == 2 and "no run directory" in missing.stderr
