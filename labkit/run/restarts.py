"""Restarting a failed run from its newest checkpoint, and starting a new run from another run's checkpoint.

    run = labkit.launch(cfg, max_restarts=3)         # after a failure every rank restarts, at most 3 times
    run = labkit.launch(cfg, resume_from=old_run)    # a new run that continues old_run from its newest checkpoint
    run.attempts()                                    # what each attempt did, and what each restart cost

labkit's training loop resumes by itself from the newest complete checkpoint in its run directory
(training/resume.py), so the launcher's part is small:
- a restart: the failed attempt's logs, error files and failure report go to attempts/<a>/ (so the next attempt's
  report reads only its own), meta.json's "attempts" list records the attempt (its ranks' pids, its failure), and
  every rank starts again in the same directory with LABKIT_ATTEMPT=<a+1> (each record says which attempt wrote it);
- resume_from: the source's newest complete checkpoint (or the one named) is copied into the new run's
  checkpoints/ before any rank starts; meta.json's "resumed_from" says where it came from.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ..records import ATTEMPT_ENV, Run, read_meta, write_meta
from ..rundir import RunDir
from ..training.state.checkpoint import CheckpointError, LATEST, checkpoints_dir, find, write_text
from .failure import LaunchError


def source_checkpoint(resume_from: Any) -> Path:
    """The complete checkpoint `resume_from` (a Run, a run directory, its checkpoints/, or a step_* directory) names."""
    where = resume_from.path if isinstance(resume_from, Run) else Path(resume_from)
    try:
        found = find(where)
    except CheckpointError as exc:
        raise LaunchError(str(exc)) from None
    if found is None:
        raise LaunchError(f"resume_from = {str(where)!r}: no complete checkpoint there. Pass a run that saved "
                          "checkpoints (RunConfig.checkpoint_every > 0), its checkpoints/ folder, or one step_* folder")
    return found


def adopt(source: Path, run_dir: Path) -> Path:
    """Copy the checkpoint `source` into run_dir/checkpoints/ and point `latest` at it; return the copy."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    copy = root / source.name
    shutil.copytree(source, copy)
    write_text(root / LATEST, copy.name + "\n")
    return copy


def attempt_env(env: dict[int, dict[str, str]], world_size: int, attempt: int | None) -> dict[int, dict[str, str]]:
    """Each rank's extra environment, with LABKIT_ATTEMPT when the run may restart."""
    if attempt is None:
        return env
    return {r: {**env.get(r, {}), ATTEMPT_ENV: str(attempt)} for r in range(world_size)}


def note_attempt(run_dir: Path, attempt: int, **fields: Any) -> None:
    """Add to (or update) meta.json's record of one attempt:  note_attempt(run_dir, 0, pids=[...])."""
    meta = read_meta(run_dir)
    attempts = meta.setdefault("attempts", [])
    row = next((a for a in attempts if a.get("attempt") == attempt), None)
    if row is None:
        row = {"attempt": attempt}
        attempts.append(row)
    row.update(fields)
    write_meta(run_dir, **meta)


def set_aside(run_dir: Path, attempt: int, failure: BaseException) -> Path:
    """Move a failed attempt's logs and error files to attempts/<attempt>/, with its failure report."""
    run_dir = RunDir(run_dir)
    aside = run_dir.attempt(attempt)
    aside.mkdir(parents=True, exist_ok=True)
    for path in list(run_dir.per_rank_files()):
        path.rename(aside / path.name)
    RunDir(aside).failure_report.write_text(str(failure))
    return aside


def restart_line(failure: BaseException, attempt: int, max_restarts: int) -> str:
    """What the launcher prints when it restarts."""
    return (f"labkit: attempt {attempt} failed ({str(failure).splitlines()[0]}); restarting every rank from the "
            f"newest checkpoint (restart {attempt + 1} of at most {max_restarts})")
