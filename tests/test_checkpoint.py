"""Checkpoints on disk: a kill at any moment of a save leaves a loadable checkpoint; no pickled code is ever run;
the RNG streams come back exactly."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from labkit.training.state import checkpoint
from labkit.training.state.checkpoint import CheckpointError, Saver, find, load_file, read_manifest, write_file
from labkit.training.state.resume import rng_state, set_rng_state

PHASES = ("partial_made", "files_written", "manifest_written", "renamed", "latest_written", "pruned")


def _save(root: Path, step: int, size: int = 1000, keep: int = 2) -> Path:
    def write(partial: Path) -> None:
        write_file(partial / "state.pt", {"weights": torch.full((size,), float(step)), "step": step})
        write_file(partial / "rank0.pt", {"step": step, "rng": rng_state()})
    return Saver(root, keep=keep).save(step, write, {"world_size": 1})


def _assert_loads(found: Path) -> int:
    """Every file of a found checkpoint loads and agrees with its manifest's step; return that step."""
    step = read_manifest(found)["step"]
    state = load_file(found / "state.pt")
    assert state["step"] == step and torch.equal(state["weights"], torch.full_like(state["weights"], float(step)))
    assert load_file(found / "rank0.pt")["step"] == step
    return step


def test_saves_are_found_loaded_and_pruned_to_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (3, 7, 11):
        _save(root, step)
    assert [p.name for p in checkpoint.step_dirs(root)] == ["step_000007", "step_000011"]
    assert (root / "latest").read_text().strip() == "step_000011"
    assert find(tmp_path) == find(root) == root / "step_000011" and _assert_loads(find(tmp_path)) == 11
    assert [json.loads(line)["step"] for line in (root / "saves.jsonl").read_text().splitlines()] == [3, 7, 11]


def _die_at(phase: str, root: Path) -> None:
    def hook(name: str) -> None:
        if name == phase:
            os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.on_phase = hook
    _save(root, 9)
    os._exit(0)


@pytest.mark.parametrize("phase", PHASES)
def test_a_kill_at_each_phase_of_a_save_leaves_a_complete_checkpoint(phase, tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 3)
    _save(root, 6)
    child = mp.get_context("fork").Process(target=_die_at, args=(phase, root))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    found = find(root)
    # Before the rename the previous checkpoint is the newest complete one; from the rename on, the new one is.
    expected = 9 if PHASES.index(phase) >= PHASES.index("renamed") else 6
    assert _assert_loads(found) == expected
    assert _save(root, 12) == root / "step_000012" and not list(root.glob(".partial-*"))  # the next save cleans up


def _save_forever(root: str, size: int) -> None:
    torch.set_num_threads(1)
    step = 0
    while True:
        _save(Path(root), step, size=size)
        step += 1


def test_kills_at_random_moments_never_leave_nothing_to_load(tmp_path):
    root = tmp_path / "checkpoints"
    rng = random.Random(0)
    mid_save = 0
    for _ in range(12):
        child = mp.get_context("fork").Process(target=_save_forever, args=(str(root), 300_000))
        child.start()
        while not (root / "latest").exists():
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        mid_save += bool(list(root.glob(".partial-*")))
        _assert_loads(find(root))
    assert mid_save >= 3, f"only {mid_save} of 12 kills landed inside a save: the test did not test much"


class _Payload:
    """What a malicious checkpoint holds: an object whose unpickling would run code (here: create a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_checkpoint_holding_a_pickled_object_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "rank0.pt"
    torch.save({"step": 3, "extra": _Payload(str(marker))}, bad)
    with pytest.raises(CheckpointError, match="refused to load .*rank0.pt.*pickled Python object"):
        load_file(bad)
    assert not marker.exists()
    good = tmp_path / "good.pt"
    write_file(good, {"step": 3, "rng": rng_state(), "names": ["a"], "nothing": None})
    assert load_file(good)["step"] == 3


def test_dcp_metadata_naming_anything_but_dcp_classes_is_refused(tmp_path):
    from labkit.training.state.sharded import SafeReader
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="pathlib.Path.touch|not part of DCP's metadata"):
        SafeReader(tmp_path).read_metadata()
    assert not marker.exists()


def test_rng_streams_come_back_exactly():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    np.random.standard_normal()  # leaves a cached gaussian in NumPy's state
    saved = rng_state()
    first = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist(), random.gauss(0, 1))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_state(saved)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist(), random.gauss(0, 1)) == first


def test_find_says_why_it_passes_over_a_broken_checkpoint(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _save(root, 4, keep=3)
    newest = _save(root, 8, keep=3)
    (newest / "state.pt").write_bytes(b"torn")  # not the size its manifest says
    assert find(root) == root / "step_000004"
    assert "names step_000008, which is not complete; using step_000004" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="state.pt is missing or not"):
        find(newest)
    assert find(tmp_path / "nothing-here") is None
