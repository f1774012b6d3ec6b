"""Version fingerprints across ranks: is every rank running the same stack?

    from labkit.tricks import envcheck
    envcheck.fingerprint()                              # this process: versions, backends, threads, env vars
    run = labkit.launch(envcheck.gather_worker, world_size=2, env={1: {"NCCL_IB_DISABLE": "1"}})
    prints = run.result(0)                              # rank 0 gathered every rank's fingerprint
    envcheck.mismatches(prints)                         # ['env.NCCL_IB_DISABLE']: the fields where ranks differ
    envcheck.table(prints)                              # one row per field, one column per rank, and 'agree'
    print(envcheck.pinned_requirements(prints[0]))      # pins for the stack rank 0 runs
    envcheck.against_lock(prints[0], Path("requirements.lock").read_text())   # {} when rank 0 runs the locked stack
    print(envcheck.dockerfile(prints[0]))               # a Dockerfile that rebuilds it

Under torchrun, call `gather(ctx)` (or all_gather_object yourself) from your own training script's start.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from typing import Any

import pandas as pd
import torch

ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "CUBLAS_", "GLOO_", "OMP_", "MKL_", "PYTORCH_")
ENV_NAMES = ("PYTHONHASHSEED", "LD_LIBRARY_PATH")
# Launcher bookkeeping that differs per rank, or per job, by design.
ENV_PER_RANK = {"TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING_RANK"}
# Fields shown for information: they may differ legitimately (nodes have names; ranks are pinned to cores).
PER_RANK_FIELDS = {"hostname", "pid", "cpu_affinity"}
PACKAGES = ("numpy", "transformers", "pandas", "scikit-learn", "tensorboard")


def fingerprint() -> dict[str, str]:
    """This process's stack as {field: value} (all strings, so ranks compare field by field)."""
    fields = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch.cuda (build)": str(torch.version.cuda),
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "None",
        "nccl": _nccl_version(),
        "gloo available": str(torch.distributed.is_gloo_available()),
        "nccl available": str(torch.distributed.is_nccl_available()),
        "mpi available": str(torch.distributed.is_mpi_available()),
        "backend": _backend(),
        "torch threads": str(torch.get_num_threads()),
        "cpu_count": str(os.cpu_count()),
        "cpu_affinity": str(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "n/a",
        "hostname": socket.gethostname(),
        "pid": str(os.getpid()),
    }
    for package in PACKAGES:
        fields[package] = _package_version(package)
    for name, value in sorted(os.environ.items()):
        if (name.startswith(ENV_PREFIXES) or name in ENV_NAMES) and name not in ENV_PER_RANK:
            fields[f"env.{name}"] = value
    return fields


def _nccl_version() -> str:
    # Asking NCCL for its version needs CUDA; on a CPU build there is no NCCL to ask.
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return "None"
    return ".".join(str(v) for v in torch.cuda.nccl.version())


def _backend() -> str:
    # The backend this process's group talks over: what was chosen, not only what was compiled in.
    dist = torch.distributed
    return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "no process group"


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gather(ctx: Any = None) -> list[dict[str, str]]:
    """Every rank's fingerprint, in rank order, on every rank (a collective: call it on all ranks)."""
    import torch.distributed as dist
    prints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, fingerprint())
    return prints


def gather_worker(ctx: Any) -> list[dict[str, str]] | None:
    """A launch target: rank 0 returns every rank's fingerprint (run.result(0)); the others return None."""
    prints = gather(ctx)
    ctx.record(0, fields=len(prints[ctx.rank]))
    return prints if ctx.rank == 0 else None


def mismatches(prints: list[dict[str, str]], *, include_per_rank: bool = False) -> list[str]:
    """Fields whose value is not the same on every rank (a field missing on a rank counts as a difference)."""
    names = sorted(set().union(*prints))
    out = [n for n in names if len({p.get(n, "<unset>") for p in prints}) > 1]
    return out if include_per_rank else [n for n in out if n not in PER_RANK_FIELDS]


def table(prints: list[dict[str, str]]) -> pd.DataFrame:
    """One row per field, one column per rank, and 'agree': "yes", "NO", or "may differ" (hostname, pid, ...)."""
    names = sorted(set().union(*prints))
    frame = pd.DataFrame({f"rank {r}": [p.get(n, "<unset>") for n in names] for r, p in enumerate(prints)},
                         index=pd.Index(names, name="field"))
    bad = set(mismatches(prints))
    frame["agree"] = ["may differ" if n in PER_RANK_FIELDS else "NO" if n in bad else "yes" for n in names]
    return frame


def highlight(frame: pd.DataFrame) -> Any:
    """The table styled for a notebook: rows where the ranks disagree in red."""
    return frame.style.apply(lambda row: ["background-color: #f8d0d0" if row["agree"] == "NO" else ""] * len(row),
                             axis=1)


def pinned_requirements(fp: dict[str, str]) -> str:
    """A requirements file pinning the stack described by a fingerprint (torch's build tag kept as a comment)."""
    torch_version, _, build = fp["torch"].partition("+")
    lines = [f"# pinned from a labkit fingerprint: python {fp['python']}, CUDA {fp['torch.cuda (build)']}, "
             f"NCCL {fp['nccl']}",
             f"torch=={torch_version}" + (f"  # build: {build}; install from the matching index" if build else "")]
    lines += [f"{name}=={fp[name]}" for name in PACKAGES if fp.get(name, "not installed") != "not installed"]
    return "\n".join(lines) + "\n"


def locked_versions(lock_text: str) -> dict[str, str]:
    """{package: version} for every exact pin (name==version) in a requirements or lock file's text."""
    out = {}
    for line in lock_text.splitlines():
        requirement = line.split("#")[0].strip()
        if "==" in requirement:
            name, version = requirement.split("==", 1)
            out[_normal(name)] = version.strip()
    return out


def against_lock(fp: dict[str, str], lock_text: str) -> dict[str, tuple[str, str]]:
    """The fingerprinted packages whose version is not the lock's pin, {name: (running, locked)}; {} when the
    fingerprinted process runs exactly what the lock pins:  against_lock(prints[0], lock_path.read_text())."""
    locked = locked_versions(lock_text)
    out = {}
    for name in ("torch", *PACKAGES):
        running = fp.get(name, "not installed").split("+")[0]   # torch's build tag (+cpu, +cu128) is not a version
        pin = locked.get(_normal(name), "not pinned")
        if running != pin:
            out[name] = (running, pin)
    return out


def _normal(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def dockerfile(fp: dict[str, str]) -> str:
    """A Dockerfile that rebuilds the fingerprinted stack: a CUDA base image when torch was built with CUDA."""
    torch_version, _, build = fp["torch"].partition("+")
    cuda = fp["torch.cuda (build)"]
    if cuda != "None":
        base = f"nvidia/cuda:{cuda}.0-cudnn-runtime-ubuntu22.04"
        index = f"https://download.pytorch.org/whl/cu{cuda.replace('.', '')}"
    else:
        base = f"python:{'.'.join(fp['python'].split('.')[:2])}-slim"
        index = "https://download.pytorch.org/whl/cpu"
    env_lines = [f"ENV {k[4:]}={v}" for k, v in fp.items() if k.startswith("env.NCCL_") or k == "env.OMP_NUM_THREADS"]
    # CUDA images carry no Python: install the distribution's, as close to the fingerprint as the image allows.
    python = ["RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip "
              "&& ln -s /usr/bin/python3 /usr/bin/python"] if cuda != "None" else []
    return "\n".join([
        f"FROM {base}",
        *python,
        "COPY requirements.txt /tmp/requirements.txt",
        f"RUN pip install --no-cache-dir torch=={torch_version} --index-url {index} \\",
        "    && pip install --no-cache-dir -r /tmp/requirements.txt",
        *env_lines,
    ]) + "\n"
