"""labkit's warm process (labkit/run/warm.py): what a notebook's cells define still launches from it, what a cell or
a test patched is still seen by the ranks, a launch after CUDA was (faked as) initialised uses it, and nothing is
left when the kernel is killed."""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback
import types
from pathlib import Path

import psutil
import pytest
import torch

import labkit
from labkit import launch

warm = importlib.import_module("labkit.run.warm")
prewarm = importlib.import_module("labkit.run.prewarm")
patches = importlib.import_module("labkit.run.patches")
cuda_guard = importlib.import_module("labkit.run.cuda_guard")
ROOT = Path(__file__).resolve().parent.parent

# A notebook's cells: a function reading a global, a closure over a variable, a function using a class defined in
# a cell; the kernel's generator seeded and an environment variable set after `import labkit`.
CELLS = ["""import json, os, torch, labkit
SCALE = 3.0""", """
def cell_fn(ctx):
    return {"v": SCALE * (ctx.rank + 1), "env": os.environ.get("WARM_TEST"), "rand": torch.rand(1).item()}

def make_closure(k):
    def closure(ctx):
        return {"v": k + ctx.rank}
    return closure

class Doubler:
    def __init__(self, v):
        self.v = v
    def twice(self):
        return 2 * self.v

def uses_class(ctx):
    return {"v": Doubler(ctx.rank + 5).twice()}

def returns_an_instance(ctx):
    return Doubler(ctx.rank)          # saved by the rank, by reference to __main__.Doubler
""", """
os.environ["WARM_TEST"] = "set after import"
torch.manual_seed(3)
runs = [labkit.launch(f, world_size=2, echo=False, progress=False)
        for f in (cell_fn, make_closure(7), uses_class, returns_an_instance)]
print("RESULT " + json.dumps({"methods": [r.meta["start_method"] for r in runs],
                              "results": [[r.result(i) for i in range(2)] for r in runs[:3]],
                              "instances": [type(runs[3].result(i)).__name__ + str(runs[3].result(i).v)
                                            for i in range(2)],
                              "kernel_rand": torch.rand(1).item()}))
""", """
import subprocess, time
def holds_a_child(ctx):
    child = subprocess.Popen(["sleep", "300"])
    for step in range(100_000):
        ctx.heartbeat(step)
        time.sleep(0.05)
labkit.launch(holds_a_child, world_size=2, timeout=600, echo=False, progress=False)
"""]


def test_cell_functions_closures_and_cell_classes_launch_from_the_warm_process_and_a_kernel_kill_leaves_nothing(
        tmp_path):
    from jupyter_client import KernelManager
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "LABKIT_RUNS": str(tmp_path)}
    env.pop("LABKIT_PREWARM", None)  # a notebook: the warm process starts at `import labkit`
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env, cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        printed = []
        for cell in CELLS[:3]:
            reply = client.execute_interactive(cell, timeout=180, output_hook=lambda m: printed.append(
                m["content"].get("text", "") + "\n".join(m["content"].get("traceback", []))))
            assert reply["content"]["status"] == "ok", "".join(printed)[-3000:]
        out = json.loads(next(line for line in "".join(printed).splitlines() if line.startswith("RESULT "))[7:])
        assert out["methods"] == ["warm"] * 4, out
        cell_fn, closure, cell_class = out["results"]
        assert [r["v"] for r in cell_fn] == [3.0, 6.0] and [r["v"] for r in closure] == [7, 8]
        assert [r["v"] for r in cell_class] == [10, 12] and out["instances"] == ["Doubler0", "Doubler1"]
        # What a rank forked from the kernel would have inherited: the variable set after import, the generator.
        assert {r["env"] for r in cell_fn} == {"set after import"}
        assert {r["rand"] for r in cell_fn} == {out["kernel_rand"]}
        kernel = psutil.Process(manager.provisioner.process.pid)
        client.execute(CELLS[3])  # runs until the kernel dies
        descendants = _wait_for(lambda: [p for p in kernel.children(recursive=True) if _name(p) == "sleep"], 2)
        descendants = kernel.children(recursive=True)
        assert {"labkit-warm", "labkit-rank0", "labkit-rank1"} <= {_name(p) for p in descendants}, descendants
        kernel.send_signal(signal.SIGKILL)
        gone = _wait_for(lambda: [p for p in descendants if not _alive(p)], len(descendants))
        assert len(gone) == len(descendants), [(p.pid, _name(p)) for p in descendants if _alive(p)]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _cold(modules=prewarm.RANK_MODULES):
    return False


@pytest.fixture
def cold_kernel_with_a_warm_process(monkeypatch):
    """This process as a notebook's at its first launches (it has not imported what ranks need), and a warm process
    forked from it after that, as `import labkit` forks it; stopped afterwards."""
    monkeypatch.setattr(prewarm, "is_warm", _cold)
    yield warm.start(afresh=False)
    warm.stop()


def state_formula(ctx):
    return labkit.memory.model_state_bytes(1000, stage=0, dp=1)


def test_a_patch_made_here_after_the_warm_process_started_is_seen_by_the_ranks(cold_kernel_with_a_warm_process,
                                                                               monkeypatch, runs_root):
    plain = launch(state_formula, world_size=1, runs_root=runs_root, echo=False)
    assert plain.meta["start_method"] == "warm" and plain.result(0) == 16000  # 16 bytes per parameter under Adam
    monkeypatch.setattr(labkit.memory, "model_state_bytes", lambda *args, **kwargs: -1.0)
    patched = launch(state_formula, world_size=1, runs_root=runs_root, echo=False)
    assert patched.meta["start_method"] == "fork" and patched.result(0) == -1.0  # forked from here: it sees it
    assert "labkit.memory.model_state_bytes" in patched.meta["start_note"]
    # A method of a class is compared too, and so is torch's.
    monkeypatch.setattr(labkit.memory.StateBytes, "total", property(lambda self: 0.0))
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: None)
    why = warm.prepare(state_formula, None, check=True)
    assert "labkit.memory.StateBytes.total" in why and "torch.distributed.broadcast" in why, why
    monkeypatch.undo()  # the patches gone, the warm process may stand in again
    monkeypatch.setattr(prewarm, "is_warm", _cold)
    assert launch(state_formula, world_size=1, runs_root=runs_root, echo=False).meta["start_method"] == "warm"


def test_after_cuda_was_initialised_auto_starts_ranks_from_a_warm_process_started_afresh(monkeypatch, runs_root,
                                                                                       no_leftovers):
    monkeypatch.setattr(cuda_guard, "cuda_is_initialised", lambda: True)
    monkeypatch.setattr(cuda_guard, "_cuda_initialised_before_labkit", False)
    monkeypatch.setattr(cuda_guard, "_cuda_init_stack", [traceback.FrameSummary("my_cell.py", 3, "<module>")])
    namespace = {"__name__": "__main__"}
    exec("def cell_worker(ctx):\n    import torch.distributed as d, torch\n    x = torch.ones(1)\n"
         "    d.all_reduce(x)\n    return x.item()\n", namespace)
    try:
        runs = [launch(namespace["cell_worker"], world_size=2, runs_root=runs_root, echo=False) for _ in range(2)]
        assert [r.meta["start_method"] for r in runs] == ["warm", "warm"]
        assert [r.result(rank) for r in runs for rank in range(2)] == [2.0] * 4
        assert not warm.current().forked  # CUDA here: started afresh, not forked from this process
    finally:
        warm.stop()


def test_a_patched_module_attribute_is_told_apart_from_an_unchanged_one(monkeypatch):
    module = types.ModuleType("labkit._patch_probe")
    exec("LIMIT = 3\ndef f():\n    return 1\nclass C:\n    def m(self):\n        return 2\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    baseline = patches.Baseline.now()
    assert module.__name__ not in baseline.changed()
    theirs = {module.__name__: patches.digest(module)}
    monkeypatch.setattr(module, "LIMIT", 4)
    monkeypatch.setattr(module.C, "m", lambda self: 3)
    changed = baseline.changed()[module.__name__]
    assert set(changed) == {"LIMIT", "C.m"}
    assert patches.differences(theirs) == [f"{module.__name__}.C.m", f"{module.__name__}.LIMIT"]  # as the warm
    # process would see it, holding the module as it was
    baseline.accept([module.__name__])
    assert module.__name__ not in baseline.changed()


def _wait_for(found, count, within_s=60.0):
    deadline = time.monotonic() + within_s
    while len(found()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found()


def _name(proc):
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return None


def _alive(proc):
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
