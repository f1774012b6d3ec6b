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
