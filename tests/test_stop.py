"""launch(stop=...): a run asked to end mid-way stops every rank, keeps what it recorded, and leaves nothing."""
from __future__ import annotations

import json
import threading
import time

from labkit import RunConfig, launch

from .conftest import leftover_processes

LONG = RunConfig(world_size=2, steps=100_000, tensorboard=False, save_final=False)


def _recorded(runs_root, rank: int) -> int:
    """Lines rank `rank` has written to its records so far (0 before the run directory exists)."""
    files = list(runs_root.glob(f"*/rank{rank}.jsonl"))
    return sum(1 for _ in files[0].open()) if files else 0


def test_stop_ends_a_run_mid_way_and_returns_what_it_recorded(runs_root, no_leftovers):
    asked = []

    def stop() -> bool:
        asked.append(time.monotonic())
        return _recorded(runs_root, 0) >= 3 and _recorded(runs_root, 1) >= 3

    run = launch(LONG, runs_root=runs_root, stop=stop, echo=False, progress=False)
    returned = time.monotonic()
    steps = run.steps()
    assert 3 <= len(steps) < LONG.steps, len(steps)
    assert json.loads((run.path / "meta.json").read_text())["outcome"] == "stopped"
    assert not run.finished and run.failure() is None
    assert returned - asked[-1] < 3.0, "the ranks were not stopped promptly"  # SIGTERM, at most 1 s grace, reap
    assert not leftover_processes()


def test_an_event_set_from_another_thread_stops_a_run_launched_in_a_thread(runs_root, no_leftovers):
    """The control panel's way: the run goes on in a thread, a button's handler sets the event."""
    event, result = threading.Event(), {}
    thread = threading.Thread(target=lambda: result.update(run=launch(LONG, runs_root=runs_root, stop=event.is_set,
                                                                      echo=False, progress=False)))
    thread.start()
    deadline = time.monotonic() + 60
    while _recorded(runs_root, 1) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    event.set()
    thread.join(timeout=10)
    assert not thread.is_alive(), "launch did not return after the stop event"
    assert 2 <= len(result["run"].steps()) < LONG.steps
    assert not leftover_processes()


def test_a_run_nobody_stops_finishes(runs_root, no_leftovers):
    run = launch(RunConfig(world_size=2, steps=3, tensorboard=False, save_final=False), runs_root=runs_root,
                 stop=threading.Event().is_set, echo=False)
    assert run.finished and len(run.steps()) == 3
