import torch

import labkit
from labkit.tricks import envcheck


def test_mismatches_name_exactly_the_fields_that_differ():
    a = {"torch": "2.13.0", "env.NCCL_DEBUG": "INFO", "pid": "1", "hostname": "n1"}
    b = {"torch": "2.13.0", "pid": "2", "hostname": "n2"}
    assert envcheck.mismatches([a, b]) == ["env.NCCL_DEBUG"]  # unset on rank 1 is a difference too
    assert envcheck.mismatches([a, b], include_per_rank=True) == ["env.NCCL_DEBUG", "hostname", "pid"]
    frame = envcheck.table([a, b])
    assert frame.loc["env.NCCL_DEBUG", "agree"] == "NO" and frame.loc["env.NCCL_DEBUG", "rank 1"] == "<unset>"
    assert frame.loc["torch", "agree"] == "yes" and frame.loc["pid", "agree"] == "may differ"


def test_pins_and_dockerfile_follow_the_fingerprint():
    fp = envcheck.fingerprint()
    assert fp["torch"] == torch.__version__
    pins = envcheck.pinned_requirements(fp)
    assert f"torch=={torch.__version__.split('+')[0]}" in pins and f"numpy=={fp['numpy']}" in pins
    cuda_fp = {**fp, "torch": "2.13.0+cu128", "torch.cuda (build)": "12.8", "env.NCCL_IB_DISABLE": "1"}
    docker = envcheck.dockerfile(cuda_fp)
    assert "FROM nvidia/cuda:12.8.0" in docker and "whl/cu128" in docker and "ENV NCCL_IB_DISABLE=1" in docker
    assert "FROM python:3.11-slim" in envcheck.dockerfile(fp)


def test_fingerprints_are_gathered_from_every_rank_and_an_injected_difference_is_flagged(runs_root, no_leftovers):
    run = labkit.launch(envcheck.gather_worker, world_size=2, env={1: {"NCCL_IB_DISABLE": "1"}},
                        runs_root=runs_root, echo=False)
    prints = run.result(0)
    assert len(prints) == 2 and prints[0]["pid"] != prints[1]["pid"]
    assert prints[0]["backend"] == prints[1]["backend"] == "gloo"          # what each rank's group talks over
    assert envcheck.fingerprint()["backend"] == "no process group"          # here, in the test process
    assert envcheck.mismatches(prints) == ["env.NCCL_IB_DISABLE"]
    clean = labkit.launch(envcheck.gather_worker, world_size=2, runs_root=runs_root, echo=False)
    assert envcheck.mismatches(clean.result(0)) == []


def test_launch_rejects_env_for_a_rank_that_does_not_exist(runs_root):
    import pytest
    with pytest.raises(labkit.LaunchError, match="env"):
        labkit.launch(envcheck.gather_worker, world_size=2, env={2: {"A": "1"}}, runs_root=runs_root)


def test_a_fingerprint_is_checked_against_the_lock_and_a_package_off_by_one_version_is_named():
    lock = "# comment\nnumpy==2.4.6\ntorch==2.13.0  # first\nPandas==3.1.1\n"
    assert envcheck.locked_versions(lock) == {"numpy": "2.4.6", "torch": "2.13.0", "pandas": "3.1.1"}
    fp = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "pandas": "3.1.1", "transformers": "5.24.0",
          "scikit-learn": "not installed", "tensorboard": "2.21.0"}
    off = envcheck.against_lock(fp, lock)
    assert off == {"transformers": ("5.24.0", "not pinned"), "scikit-learn": ("not installed", "not pinned"),
                   "tensorboard": ("2.21.0", "not pinned")}
    assert envcheck.against_lock({**fp, "numpy": "2.4.5"}, lock)["numpy"] == ("2.4.5", "2.4.6")


def test_this_environment_runs_exactly_what_the_kits_lock_pins():
    from pathlib import Path
    lock = (Path(__file__).parents[1] / "requirements.lock").read_text()
    assert envcheck.against_lock(envcheck.fingerprint(), lock) == {}
