"""The run directory's one owner: where runs go (runs_root) and what every file in a run is called (RunDir).

    root = runs_root()                      # $LABKIT_RUNS, else ./runs
    run_dir = RunDir.new(root, "tinylm-w2") # runs/20261201-203501-tinylm-w2-1a2b/, created
    run_dir.records(1)                      # .../rank1.jsonl
    RunDir.claim("out/job1")                # exactly out/job1 (created), refused if it already holds records

Layout (the same under labkit's launcher and under torchrun):

    config.json          the RunConfig (absent for a plain function launch)
    meta.json            launch time, world size, start method, attempts, outcome, ...
    rank<r>.jsonl        one JSON object per recorded step, flushed line by line
    rank<r>.log          the rank's stdout and stderr (and faulthandler dumps)
    rank<r>.error.json   written when the rank raised: step, exception, traceback
    rank<r>.beat         a watched rank's progress (`labkit watch`: time, step, state, newest collective)
    rank<r>.fr.json      a rank's flight recorder, dumped when it stalled (lesson 12, `labkit watch`)
    trace<r>.json        a rank's torch.profiler trace, Chrome trace JSON (RunConfig.profile_step; lessons 16, 18)
    watch.ask, job.log   `labkit watch`'s request for those dumps; the watched command's output (notebooks)
    result<r>.pt         what a launched function returned on rank r
    failure.txt          the launcher's failure report
    pipeline<r>.now      a pipeline rank's current action, one line rewritten in place (strategy "pp")
    wire<r>.now          the pipeline exercise's current send/receive on rank r (labkit.exercises)
    tb/rank<r>/          TensorBoard events, written from the records when the run ends
    final/rank<r>.pt     final parameters (RunConfig.save_final)
    checkpoints/         checkpoints (RunConfig.checkpoint_every; training/state/checkpoint.py owns its inside)
    attempts/<a>/        a restarted run's earlier attempts: their logs, error files, failure report

Every other module asks a RunDir for a path (or a name: RunDir(".").log(r).name) instead of spelling a file name, in
paths and in messages alike; tests/test_public_surface.py::test_run_directory_file_names_are_spelled_in_rundir_only
checks every string and f-string of the package (training/state/checkpoint.py owns the inside of checkpoints/).
"""
from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

RUNS_ENV = "LABKIT_RUNS"
"""The environment variable naming where runs go (make test points it at a scratch folder)."""
DEFAULT_RUNS = "runs"


def runs_root(root: str | Path | None = None) -> Path:
    """Where runs go: `root` when given, else $LABKIT_RUNS, else ./runs:  runs_root() -> Path("runs")."""
    return Path(root) if root not in (None, "") else Path(os.environ.get(RUNS_ENV) or DEFAULT_RUNS)


class RunDirInUse(FileExistsError):
    """A directory asked for as a new run's directory already holds another run's records."""


@dataclass(frozen=True)
class RunDir:
    """One run's directory and the names of everything in it (see the module docstring)."""

    path: Path

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    # --- making one ------------------------------------------------------------------------------------------

    @classmethod
    def new(cls, root: str | Path, label: str) -> "RunDir":
        """A fresh directory under `root`, named by the time, `label` and a random tag, created now."""
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")[:60] or "run"
        for _ in range(8):   # two launches of one label in the same second may draw the same tag: draw again
            path = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(2)}"
            try:
                path.mkdir(parents=True)
                return cls(path)
            except FileExistsError:
                continue
        raise RunDirInUse(f"{root}: 8 new run directories for {label!r} in a row already existed")

    @classmethod
    def claim(cls, path: str | Path, *, resuming: bool = False) -> "RunDir":
        """Exactly `path` as a new run's directory (created with its parents). One that already holds records is
        refused, since this run's records would be appended to another run's, unless `resuming` that run."""
        run_dir = cls(path)
        if run_dir.path.exists() and not run_dir.path.is_dir():
            raise RunDirInUse(f"{run_dir.path} is a file, not a directory: name a directory for the run")
        if not resuming and run_dir.holds_records():
            raise RunDirInUse(f"{run_dir.path} already holds the records of a run ({run_dir.records(0).name}, ...): "
                              "name a new directory, or delete that one")
        run_dir.path.mkdir(parents=True, exist_ok=True)
        return run_dir

    # --- what is in it ---------------------------------------------------------------------------------------

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def meta(self) -> Path:
        return self.path / "meta.json"

    @property
    def failure_report(self) -> Path:
        return self.path / "failure.txt"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def final(self) -> Path:
        return self.path / "final"

    def records(self, rank: int) -> Path:
        return self.path / f"rank{rank}.jsonl"

    def log(self, rank: int) -> Path:
        return self.path / f"rank{rank}.log"

    def error(self, rank: int) -> Path:
        return self.path / f"rank{rank}.error.json"

    def result(self, rank: int) -> Path:
        return self.path / f"result{rank}.pt"

    def pidfile(self, rank: int) -> Path:
        """A rank's process id, written by a rank that wants to be found from outside (py-spy)."""
        return self.path / f"rank{rank}.pid"

    def pidfiles(self) -> list[Path]:
        return _by_rank(self.path.glob("rank*.pid"))

    def pipeline_now(self, rank: int) -> Path:
        """The action a pipeline rank's stages are in, rewritten in place at each one (a hang report reads it)."""
        return self.path / f"pipeline{rank}.now"

    def wire_now(self, rank: int) -> Path:
        """The send or receive the pipeline exercise's rank is in (the checker names a deadlock from it)."""
        return self.path / f"wire{rank}.now"

    def flight_record(self, rank: int) -> Path:
        """torch's flight recorder of one rank, dumped when it stalled (lesson 12's tools)."""
        return self.path / f"rank{rank}.fr.json"

    def trace(self, rank: int) -> Path:
        """A rank's torch.profiler trace, Chrome trace JSON (chrome://tracing, Perfetto):  run_dir.trace(0)."""
        return self.path / f"trace{rank}.json"

    def beat(self, rank: int) -> Path:
        """A watched rank's progress (`labkit watch`): four numbers rewritten in place (training/agent.py)."""
        return self.path / f"rank{rank}.beat"

    def beats(self) -> list[Path]:
        return _by_rank(self.path.glob("rank*.beat"))

    @property
    def watch_request(self) -> Path:
        """Written by `labkit watch` when the ranks stalled: each watched rank then dumps its flight recorder."""
        return self.path / "watch.ask"

    @property
    def job_output(self) -> Path:
        """What a watched command printed (stdout and stderr), when `labkit.watch` runs it from a notebook."""
        return self.path / "job.log"

    def flight_records(self) -> list[Path]:
        return _by_rank(self.path.glob("rank*.fr.json"))

    def final_params(self, rank: int) -> Path:
        return self.final / f"rank{rank}.pt"

    def tensorboard(self, rank: int | None = None) -> Path:
        return self.path / "tb" if rank is None else self.path / "tb" / f"rank{rank}"

    def attempt(self, attempt: int) -> Path:
        """Where an earlier attempt's logs, error files and report are set aside when the run restarts."""
        return self.path / "attempts" / str(attempt)

    def record_files(self) -> list[Path]:
        """Every rank's records file, by rank."""
        return _by_rank(self.path.glob("rank*.jsonl"))

    def error_files(self) -> list[Path]:
        return _by_rank(self.path.glob("rank*.error.json"))

    def per_rank_files(self) -> Iterator[Path]:
        """The files a rank of one attempt leaves beside the records (logs, error files): set aside on a restart."""
        yield from self.path.glob("rank*.log")
        yield from self.path.glob("rank*.error.json")

    def holds_records(self) -> bool:
        return any(self.path.glob("rank*.jsonl"))

    def missing_records(self, world_size: int) -> list[int]:
        """Ranks of a world of `world_size` that left no records file."""
        return [r for r in range(world_size) if not self.records(r).exists()]


def rank_of(path: str | Path) -> int:
    """The rank a per-rank file belongs to:  rank_of("runs/x/rank3.error.json") -> 3."""
    match = re.match(r"(?:rank|result)(\d+)", Path(path).name)
    if not match:
        raise ValueError(f"{path}: not a per-rank file of a run directory")
    return int(match.group(1))


def _by_rank(paths: Iterator[Path]) -> list[Path]:
    return sorted(paths, key=rank_of)
