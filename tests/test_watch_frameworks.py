"""labkit's framework callbacks (labkit/training/callbacks.py): each rank's own loss recorded, per optimizer step,
for the HF Trainer and Lightning, under `labkit watch` with no change to the script and by hand.

The jobs are tests/jobs/trainer_job.py and tests/jobs/lightning_job.py: tiny models on CPU, three optimizer steps,
two ranks, each rank printing "rank R step S loss L" with every digit, to compare with the records."""
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import labkit
from labkit.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"
STEPS = 3
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # this environment's, whatever PATH holds
EXTRA = "the frameworks extra is not installed: pip install -c requirements.lock -e '.[frameworks]'"
needs_trainer = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")),
                                   reason=EXTRA)
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason=EXTRA)


def printed(text: str) -> dict[tuple[int, int], list[float]]:
    """{(rank, step): [loss, ...]} from the job's "rank R step S loss L" lines, in the order printed."""
    out: dict[tuple[int, int], list[float]] = {}
    for rank, step, loss in re.findall(r"^rank (\d+) step (\d+) loss (\S+)$", text, flags=re.M):
        out.setdefault((int(rank), int(step)), []).append(float(loss))
    return out


def one_record_per_rank_and_step(df) -> None:
    assert sorted(zip(df["rank"], df["step"])) == [(r, s) for r in (0, 1) for s in range(STEPS)], df[["rank", "step"]]


def own_losses(df, losses: dict[tuple[int, int], list[float]], column: str, scale: str | None = None) -> None:
    """Each record's `column` (times `scale`, a column) is the mean of what that rank printed at that step, and the
    ranks' losses differ at every step (their own, not an average)."""
    for row in df.itertuples():
        value = getattr(row, column) * (getattr(row, scale) if scale else 1)
        mine = losses[(row.rank, row.step)]
        assert value == pytest.approx(sum(mine) / len(mine), rel=1e-6), (row.rank, row.step, value, mine)
    by_rank = df.pivot(index="step", columns="rank", values=column)
    assert (by_rank[0] != by_rank[1]).all(), by_rank


@needs_trainer
def test_a_trainer_job_under_watch_records_each_ranks_own_loss(tmp_path, monkeypatch, no_leftovers):
    """No callback in the script: torchrun sets RANK, so the agent records each step from the Trainer's backward."""
    monkeypatch.chdir(tmp_path)
    run = labkit.watch([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(JOBS / "trainer_job.py")],
                       timeout=30, run_dir=tmp_path / "run", echo=False)
    output = RunDir(run.path).job_output.read_text()
    assert labkit.watch_report(run).outcome == "finished", output
    df = run.df
    one_record_per_rank_and_step(df)
    assert (df["backward_calls"] == 2).all()  # two micro-batches per step, each loss divided by 2 for backward
    own_losses(df, printed(output), "loss", scale="backward_calls")


@needs_lightning
def test_a_lightning_job_under_watch_gets_the_callback_from_the_entry_point(tmp_path, monkeypatch, no_leftovers):
    """`python lightning_job.py` (no callback in it): Lightning starts rank 1 itself, neither process has RANK, and
    the entry point's callback starts the agent in both, noting each rank's raw training_step loss."""
    monkeypatch.chdir(tmp_path)
    entry_points = declared_entry_points(tmp_path / "entry-points")
    if entry_points:
        monkeypatch.setenv("PYTHONPATH", path_with(entry_points))
    run = labkit.watch([sys.executable, str(JOBS / "lightning_job.py")], timeout=30, run_dir=tmp_path / "run",
                       echo=False)
    output = RunDir(run.path).job_output.read_text()
    assert labkit.watch_report(run).outcome == "finished", output
    assert sorted(re.findall(r"^env (\d) RANK=(\S+)", output, flags=re.M)) == [("0", "None"), ("1", "None")], output
    df = run.df
    one_record_per_rank_and_step(df)
    own_losses(df, printed(output), "raw_loss")
    own_losses(df, printed(output), "loss")  # no accumulation, no AMP: what backward got is the raw loss
    assert list(df[df["rank"] == 0]["trainer_step"]) == [1, 2, 3]
    assert (df["grad_norm"] > 0).all()  # measured after Lightning's closure ran backward, even at step 0


@needs_trainer
def test_the_trainer_callback_by_hand_starts_the_agent_into_its_run_dir(tmp_path):
    """Without watch: callbacks=[LabkitTrainerCallback(run_dir=...)] under plain torchrun; each rank records as
    the Trainer's process_index, with the Trainer's own step number and the clipping it did."""
    records = tmp_path / "runs" / "x"
    job = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(JOBS / "trainer_job.py"),
                          "--run-dir", str(records)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=with_labkit())
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    df = labkit.load_run(records).df
    one_record_per_rank_and_step(df)
    own_losses(df, printed(job.stdout), "loss", scale="backward_calls")
    assert list(df[df["rank"] == 1]["trainer_step"]) == [1, 2, 3] and (df["grad_clip"] == 1.0).all()


def test_the_callbacks_module_imports_no_framework_and_the_factories_add_nothing_outside_watch():
    code = ("import os, sys; os.environ.pop('LABKIT_WATCH_DIR', None)\n"
            "import labkit, labkit.training.callbacks as c\n"
            "assert c.lightning_callbacks() == [] and c.pytorch_lightning_callbacks() == []\n"
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=with_labkit())
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def with_labkit() -> dict[str, str]:
    """This environment, with this checkout's labkit first on the path (a job started without labkit watch)."""
    return {**os.environ, "PYTHONPATH": path_with(str(ROOT))}


def path_with(folder: str) -> str:
    return os.pathsep.join([folder] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def declared_entry_points(folder: Path) -> str | None:
    """labkit's Lightning entry points as pyproject.toml declares them, in a folder for the job's PYTHONPATH, when
    the installed labkit lacks them (an editable install made before they were declared; `make install` redoes it
    when pyproject.toml changes); None when it has them (a second copy would add the callback twice)."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    group = "lightning.pytorch.callbacks_factory"
    if set(groups[group].values()) <= {e.value for e in importlib.metadata.entry_points(group=group)}:
        return None
    info = folder / "labkit_entry_points-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: labkit-entry-points\nVersion: 0\n")
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items())
                                                   for g, e in groups.items()))
    return str(folder)
