"""The GPU path's decisions, checked on a CPU: which backend and device each rank gets, what an NCCL request on too
few GPUs says, which records carry CUDA memory, and the refusal to fork once CUDA is initialised.

What only a GPU can show (NCCL really running, fp16 speed, real CUDA peak memory) is in bench/gpu_check.py, a
script for a machine with one or more GPUs."""
import importlib
import traceback

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import LaunchError, RunConfig
from labkit.run.launch import choose_start_method
from labkit.run.session import rank_device, resolve_backend
from labkit.training.loop import memory_fields

cuda_guard = importlib.import_module("labkit.run.cuda_guard")


def fake_gpus(monkeypatch, count: int, nccl: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)


@pytest.mark.parametrize("gpus, nccl, world, expected", [
    (0, False, 2, "gloo"),   # a laptop
    (8, True, 8, "nccl"),    # a GPU per rank
    (8, True, 9, "gloo"),    # more ranks than GPUs: NCCL would put two ranks on one GPU
    (1, True, 1, "nccl"),
    (4, False, 2, "gloo"),   # a CUDA build without NCCL (Windows, some source builds)
])
def test_auto_picks_nccl_only_when_every_rank_has_a_gpu(monkeypatch, gpus, nccl, world, expected):
    fake_gpus(monkeypatch, gpus, nccl)
    assert resolve_backend("auto", world) == expected
    assert resolve_backend("gloo", world) == "gloo"  # asked for by name: kept


def test_nccl_on_too_few_gpus_is_refused_with_the_counts(monkeypatch):
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"needs 2 CUDA GPUs here.*1 visible \(CUDA_VISIBLE_DEVICES=3\)"):
        resolve_backend("nccl", 2)
    assert resolve_backend("nccl", 1) == "nccl"


def test_launch_refuses_nccl_without_a_gpu_per_rank_before_any_rank_starts(tmp_path, monkeypatch):
    import labkit
    from labkit.run.launch import LaunchError
    fake_gpus(monkeypatch, 1)
    with pytest.raises(LaunchError, match=r"RunConfig.backend = 'nccl'.*needs 2 CUDA GPUs here.*1 visible"):
        labkit.launch(labkit.RunConfig(backend="nccl", world_size=2), runs_root=tmp_path, echo=False)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())      # refused before a run directory was made


def test_each_rank_computes_on_the_gpu_of_its_local_rank():
    assert [rank_device("nccl", r) for r in range(3)] == [torch.device("cuda", r) for r in range(3)]
    assert rank_device("gloo", 5) == torch.device("cpu")


def test_cuda_peak_memory_is_recorded_from_the_ranks_own_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: asked.append(device) or 96 * 2**20)
    fields = memory_fields(torch.device("cuda", 1))
    assert fields["cuda_peak_mb"] == 96.0 and asked == [torch.device("cuda", 1)]
    assert "cuda_peak_mb" not in memory_fields(torch.device("cpu"))


def test_records_of_a_cpu_run_carry_no_cuda_fields(runs_root, no_leftovers):
    run = labkit.launch(RunConfig(world_size=1, steps=2, tensorboard=False, precision="fp16"), runs_root=runs_root,
                        echo=False, progress=False)
    assert not [c for c in run.df.columns if "cuda" in c]
    assert run.df["rss_mb"].gt(0).all() and run.df["loss_scale"].eq(2.0**16).all()  # fp16's GradScaler, on CPU


def test_cuda_initialised_before_labkit_is_said_so(monkeypatch):
    monkeypatch.setattr(cuda_guard, "cuda_is_initialised", lambda: True)
    monkeypatch.setattr(cuda_guard, "_cuda_initialised_before_labkit", True)
    assert "before labkit was imported" in cuda_guard.cuda_init_culprit()
    with pytest.raises(LaunchError, match="import labkit first"):
        choose_start_method("fork")
    assert choose_start_method("spawn") == "spawn"




def test_with_torchao_installed_on_a_gpu_machine_ranks_are_spawned_not_forked(monkeypatch):
    """torchao, once imported (transformers imports it when installed), leaves a GPU machine's forked children unable
    to use CUDA (measured on an H200): auto spawns, and an explicit fork or warm is refused naming torchao."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    from labkit.run import cuda_guard
    assert "torchao is installed" in cuda_guard.fork_poisoned_by()
    assert choose_start_method("auto") == "spawn" and choose_start_method("spawn") == "spawn"
    for method in ("fork", "warm"):
        with pytest.raises(LaunchError, match="torchao is installed"):
            choose_start_method(method)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)   # a CPU machine: fork as ever
    assert cuda_guard.fork_poisoned_by() is None and choose_start_method("fork") == "fork"
