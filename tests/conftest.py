"""Shared fixtures: a scratch runs folder per test, and a check that no process outlives a launch. The hooks that
make test's lessons and tests share (the claims' summary, the claims floors, the lessons' time limit, which lessons
run beside the tests) are in the root conftest.py: a conftest here would not apply to notebooks/."""
from __future__ import annotations

import psutil
import pytest


def leftover_processes() -> list[psutil.Process]:
    """Descendants of this test process, except multiprocessing's interpreter-wide resource tracker (a helper
    Python starts once for spawn and keeps until exit; it is not a rank)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture
def runs_root(tmp_path):
    return tmp_path / "runs"


@pytest.fixture
def no_leftovers():
    """Fails the test if any process it started is still alive at its end."""
    yield
    left = leftover_processes()
    assert not left, f"processes left alive: {[(p.pid, p.cmdline()) for p in left]}"


def copy_without_model_counts(run_dir, dest):
    """A copy of a run's meta and records as labkit wrote them before records held the model's counts (no model_*
    fields): what an older run directory looks like. Returns `dest`."""
    import json
    from pathlib import Path
    run_dir, dest = Path(run_dir), Path(dest)
    dest.mkdir()
    (dest / "meta.json").write_text((run_dir / "meta.json").read_text())
    for records in sorted(run_dir.glob("rank*.jsonl")):
        rows = [json.loads(line) for line in records.read_text().splitlines()]
        (dest / records.name).write_text("".join(
            json.dumps({k: v for k, v in r.items() if not k.startswith("model_")}) + "\n" for r in rows))
    return dest

