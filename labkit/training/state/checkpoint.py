"""Checkpoints on disk: written so that a kill at any moment leaves the last good one readable, found again, and
read without running code from the file.

    saver = Saver(run_dir / "checkpoints", rank=ctx.rank, barrier=dist.barrier, keep=2)
    saver.save(step, lambda partial: write_file(partial / f"rank{ctx.rank}.pt", {"step": step}))
    found = find(run_dir)                     # the checkpoint to resume from, or None
    state = load_file(found / "rank0.pt")     # torch.load(weights_only=True), with a clear refusal

Layout of runs/<id>/checkpoints/:
    latest                  the name of the newest complete checkpoint ("step_000011"), replaced atomically
    step_000011/            the state after step 11 (training resumes at step 12)
        manifest.json       written last: step, world size, format, every file with its size
        state.pt            model and optimizer, written by rank 0 (format "full"; "dcp" writes sharded/ instead)
        rank0.pt, ...       each rank's own: RNG streams, data position, GradScaler and plateau state
    .partial-step_000015/   a save in progress, or one a kill interrupted: never read; the next save removes it
    saves.jsonl             one line per save: step, seconds, bytes

A save (every rank calls it with the same step; `barrier` is dist.barrier, or nothing on one rank):
    1. rank 0 removes any leftover .partial-* directory and makes a new one; barrier
    2. every rank writes its files into it, each flushed and fsynced; barrier
    3. rank 0 writes manifest.json, fsyncs the directory, renames .partial-step_N to step_N (one atomic rename),
       fsyncs checkpoints/, replaces `latest` (temporary file, fsync, rename, fsync), then deletes all but the
       newest `keep` checkpoints, each manifest first (a half-deleted checkpoint is never taken for a complete one).
Until the rename, the previous checkpoint is the newest complete one; after it, the new one is, whether or not
`latest` was updated yet. So no moment of the save leaves nothing to resume from (tests/test_checkpoint.py kills
a saving process at every one of these steps, and at random times).

Reading: `find` takes the newest complete step_* directory: the one `latest` names, except between the rename and
the replacement of `latest` (then the newer one), or when `latest` names one that is gone (it says so). `latest` is
for people and other tools. Files are read with torch.load(weights_only=True): tensors, numbers, strings, lists,
tuples and dicts only. A file holding any other pickled object is refused before that object is built, so its code
never runs.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...rundir import RunDir

LATEST = "latest"
MANIFEST = "manifest.json"
PARTIAL = ".partial-"
SAVES_LOG = "saves.jsonl"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")

on_phase: Callable[[str], None] | None = None
"""Tests set this to see (and kill the process at) each phase of a save: "partial_made", "files_written",
"manifest_written", "renamed", "latest_written", "pruned"."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: incomplete, written by a different setup, or holding more than plain data."""


def step_dir_name(step: int) -> str:
    """The directory of the checkpoint taken after `step`:  step_dir_name(11) -> "step_000011"."""
    return f"step_{step:06d}"


def shard_file(step_dir: Path, rank: int) -> Path:
    """One rank's file in a checkpoint:  shard_file(step_dir, 1) -> step_dir / "rank1.pt"."""
    return Path(step_dir) / f"rank{rank}.pt"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return RunDir(run_dir).checkpoints


# --- writing ---------------------------------------------------------------------------------------------------

def write_file(path: Path, obj: Any, *, die_half_way: bool = False) -> int:
    """torch.save `obj` to `path` through a temporary name (flush, fsync, rename); return the bytes written.
    die_half_way: write half of the bytes, fsync, and SIGKILL this process (Fault kind "kill_in_save")."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if die_half_way:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def write_text(path: Path, text: str) -> None:
    """Replace the text file `path` atomically: a temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Saver:
    """Save checkpoints into `root` as one of `world_size` ranks (see the module docstring for the protocol)."""

    def __init__(self, root: Path, *, rank: int = 0, barrier: Callable[[], Any] = lambda: None, keep: int = 2):
        self.root, self.rank, self.barrier, self.keep = Path(root), rank, barrier, keep

    def save(self, step: int, write: Callable[[Path], Any], meta: dict[str, Any] | None = None) -> Path:
        """Call write(partial_dir) on this rank to write its files; return the checkpoint's final directory."""
        started = time.perf_counter()
        final = self.root / step_dir_name(step)
        partial = self.root / (PARTIAL + final.name)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.glob(PARTIAL + "*"):
                shutil.rmtree(leftover, ignore_errors=True)  # a save that a kill interrupted
            partial.mkdir()
            _phase("partial_made")
        self.barrier()
        write(partial)
        self.barrier()
        if self.rank == 0:
            _phase("files_written")
            manifest = {"format_version": FORMAT_VERSION, "step": step, "files": _sizes(partial),
                        "written_at": time.time(), **(meta or {})}
            with open(partial / MANIFEST, "w") as f:
                f.write(json.dumps(manifest, indent=1))
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(partial)
            _phase("manifest_written")
            if final.exists():  # the same step saved again (a restarted run): the new one replaces it
                _remove(final)
            os.rename(partial, final)
            fsync_dir(self.root)
            _phase("renamed")
            write_text(self.root / LATEST, final.name + "\n")
            _phase("latest_written")
            self.prune()
            _phase("pruned")
            seconds = time.perf_counter() - started
            with open(self.root / SAVES_LOG, "a") as log:
                log.write(json.dumps({"step": step, "seconds": seconds, "bytes": sum(manifest["files"].values()),
                                      "time": time.time(), **(meta or {}).get("log", {})}) + "\n")
        return final

    def prune(self) -> None:
        """Delete all but the newest `keep` complete checkpoints."""
        complete = [d for d in step_dirs(self.root) if incomplete_reason(d) is None]
        for old in complete[:-self.keep]:
            _remove(old)


def _remove(step_dir: Path) -> None:
    (step_dir / MANIFEST).unlink(missing_ok=True)  # first: from here on it is incomplete, never loaded
    fsync_dir(step_dir)
    shutil.rmtree(step_dir, ignore_errors=True)


def _sizes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def _phase(name: str) -> None:
    if on_phase is not None:
        on_phase(name)


# --- finding and reading ---------------------------------------------------------------------------------------

def step_dirs(root: Path) -> list[Path]:
    """The step_* directories under `root`, oldest step first (complete or not)."""
    found = [(int(m.group(1)), p) for p in Path(root).glob("step_*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def incomplete_reason(step_dir: Path) -> str | None:
    """None when `step_dir` is a complete checkpoint, else why it is not."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{step_dir.name} has no readable {MANIFEST} (a save that did not finish, or a deletion)"
    for name, size in manifest.get("files", {}).items():
        path = step_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{step_dir.name}/{name} is missing or not {size} bytes"
    return None


def find(where: str | Path, *, say: Callable[[str], Any] = print) -> Path | None:
    """The complete checkpoint to resume from, or None: `where` is a run directory, its checkpoints/ directory, or
    one step_* directory (which must be complete):  find("runs/tinylm-w2-...") -> .../checkpoints/step_000011."""
    where = Path(where)
    if _STEP_DIR.match(where.name):
        why = incomplete_reason(where)
        if why:
            raise CheckpointError(f"cannot resume from {where}: {why}. Pass its run directory to take the newest "
                                  "complete checkpoint instead")
        return where
    inside = RunDir(where).checkpoints
    root = where if where.name == inside.name or not inside.is_dir() else inside
    complete = [d for d in step_dirs(root) if incomplete_reason(d) is None] if root.is_dir() else []
    try:
        named = (root / LATEST).read_text().strip()
    except OSError:
        named = None
    if complete and named not in (None, complete[-1].name) and incomplete_reason(root / named):
        say(f"labkit: {root / LATEST} names {named}, which is not complete; using {complete[-1].name}")
    return complete[-1] if complete else None


def read_manifest(step_dir: Path) -> dict[str, Any]:
    return json.loads((Path(step_dir) / MANIFEST).read_text())


def load_file(path: Path) -> Any:
    """torch.load(path, weights_only=True): plain data only; anything else is refused, naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise CheckpointError(
                f"refused to load {path}: it holds a pickled Python object, and loading it would run code from the "
                f"file. labkit writes tensors, numbers, strings, lists and dicts only, so this file was not written "
                f"by labkit (or was altered). torch said: {str(exc).splitlines()[0]}") from None
        raise
