"""labkit's GPU path, checked in one go on a machine with NVIDIA GPUs (CI and the CPU tests cannot: no GPU there).

    python bench/gpu_check.py                 # from the repository root, with a CUDA build of torch; ~2-4 min
    PYTHONPATH=. python3 bench/gpu_check.py   # where labkit is not installed: the checkout is imported as is
    python bench/gpu_check.py --quick         # fewer steps and rounds

Needs torch with CUDA, pandas, matplotlib, transformers, scikit-learn, tensorboard, cloudpickle, psutil (ipywidgets
and JupyterLab are not needed). G below is the number of GPUs this process sees (CUDA_VISIBLE_DEVICES narrows it).
Each check prints PASS or FAIL with what it measured; the exit status is the number of FAILs.

1. auto backend: resolve_backend("auto", G) is nccl, and G+1 ranks fall back to gloo; nccl on G+1 ranks is refused.
2. ranks on GPUs: launch(fn, world_size=G) forks (CUDA untouched here), each rank's group is nccl on cuda:<rank>,
   the current device is its own, and an NCCL all_reduce sums over the ranks.
3. training: RunConfig(world_size=G, precision="fp16") trains on the GPUs: records carry cuda_peak_mb (> 0, below
   the card's memory), GradScaler("cuda")'s scale (2**16), finite falling losses; a NaN on rank 0 at step 2 makes
   GradScaler skip that step on every rank and halve the scale.
4. torchrun: --standalone --nproc-per-node G -m labkit run: meta.json puts rank r on cuda:r, records carry cuda_peak_mb.
5. precision speed (measured, not gated): fp32, bf16, fp16 samples/s of one rank on a larger tinylm, rounds
   alternated; AMP's speed is a GPU fact the CPU lessons can only describe.
6. NCCL all_reduce busbw at 64 MiB (world G; at G=1 there is no wire: it only shows NCCL runs).
7. the fork guard, last (it initialises CUDA here on purpose): start_method="fork" then raises LaunchError naming
   this file's line, "auto" spawns and trains; seconds to the first step for fork (check 3) and spawn.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's labkit, installed or not

import labkit  # noqa: E402
from labkit import Fault, LaunchError, RunConfig  # noqa: E402
from labkit.run.rank import resolve_backend  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []
MEASURED: dict[str, Any] = {}  # what one check learns and a later one needs (the GPU's memory, fork's first step)


def check(name: str) -> Callable[[Callable[..., str]], Callable[..., None]]:
    """Run the decorated check; an AssertionError or any exception is a FAIL with its message, else PASS."""
    def wrap(fn: Callable[..., str]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            started = time.perf_counter()
            try:
                detail, ok = fn(*args), True
            except Exception as exc:  # noqa: BLE001 - report and go on to the next check
                detail, ok = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}", False
            if torch.cuda.is_initialized() and not name.startswith("7."):
                # This process must leave CUDA alone until check 7, or every launch after it has to spawn.
                detail, ok = f"{detail}\n(and it initialised CUDA in the checking process)", False
            RESULTS.append((name, ok, detail))
            print(f"[{'PASS' if ok else 'FAIL'}] {name} ({time.perf_counter() - started:.1f} s)\n    "
                  + str(detail).replace("\n", "\n    "), flush=True)
        return run
    return wrap


@check("1. auto backend")
def backend_choice(gpus: int) -> str:
    assert resolve_backend("auto", gpus) == "nccl", "auto did not pick nccl with a GPU per rank"
    assert resolve_backend("auto", gpus + 1) == "gloo", "auto picked nccl with more ranks than GPUs"
    try:
        resolve_backend("nccl", gpus + 1)
        raise AssertionError("nccl on more ranks than GPUs was not refused")
    except ValueError as exc:
        refusal = str(exc).split(";")[0]
    return f"auto on {gpus} ranks: nccl; on {gpus + 1}: gloo; nccl on {gpus + 1}: refused ({refusal})"


def where_am_i(ctx: Any) -> dict:
    import torch.distributed as dist
    total = torch.ones(1, device=ctx.device) * (ctx.rank + 1)
    dist.all_reduce(total)
    properties = torch.cuda.get_device_properties(ctx.device)
    return {"backend": dist.get_backend(), "device": str(ctx.device), "current": torch.cuda.current_device(),
            "sum": total.item(), "gpu": properties.name, "memory_mb": properties.total_memory / 2**20,
            "nccl": str(torch.cuda.nccl.version())}


@check("2. ranks on GPUs")
def ranks_on_gpus(gpus: int, root: Path) -> str:
    run = labkit.launch(where_am_i, world_size=gpus, runs_root=root, echo=False, progress=False)
    seen = [run.result(r) for r in range(gpus)]
    assert run.meta["start_method"] == "fork", run.meta["start_method"]
    for r, s in enumerate(seen):
        assert s["backend"] == "nccl" and s["device"] == f"cuda:{r}" and s["current"] == r, (r, s)
        assert s["sum"] == gpus * (gpus + 1) / 2, (r, s)
    MEASURED["memory_mb"] = min(s["memory_mb"] for s in seen)
    return f"fork; {seen}"


@check("3. fp16 training on GPUs")
def training(gpus: int, root: Path, steps: int) -> str:
    cfg = RunConfig(world_size=gpus, global_batch=32 * gpus, steps=steps, precision="fp16", tensorboard=False)
    run = labkit.launch(cfg, runs_root=root, echo=False, progress=False)
    df, total_mb = run.df, MEASURED.get("memory_mb", math.inf)
    assert "cuda_peak_mb" in df and df["cuda_peak_mb"].between(0, total_mb, inclusive="neither").all(), \
        df.get("cuda_peak_mb")
    assert (df["loss_scale"] == 2.0**16).all() and df["skipped_step"].eq(0).all()
    losses = run.steps()["loss"]
    assert losses.map(math.isfinite).all() and losses.iloc[-1] < losses.iloc[0], losses.tolist()
    nan = cfg.replace(steps=5, nan_policy="ignore", faults=(Fault(kind="nan", rank=0, step=2),))
    skipped = labkit.launch(nan, runs_root=root, echo=False, progress=False).df
    per_step = skipped.groupby("step")[["skipped_step", "loss_scale"]].max()
    assert per_step["skipped_step"].tolist() == [0, 0, 1, 0, 0], per_step
    assert per_step["loss_scale"].tolist() == [2.0**16] * 3 + [2.0**15] * 2, per_step
    MEASURED["fork_first_step_s"] = run.summary()["time_to_first_step_s"]
    return (f"cuda_peak_mb per rank {df.groupby('rank')['cuda_peak_mb'].max().round(1).tolist()} of {total_mb:.0f}; "
            f"loss {losses.iloc[0]:.3f} -> {losses.iloc[-1]:.3f}; {run.summary()['median_samples_per_s']:.0f} "
            f"samples/s; a NaN at step 2: skipped on every rank, scale 65536 -> 32768; first step after "
            f"{MEASURED['fork_first_step_s']:.2f} s (fork)")


@check("4. torchrun on GPUs")
def under_torchrun(gpus: int, root: Path) -> str:
    config, run_dir = root / "torchrun.json", root / "torchrun-job"
    RunConfig(world_size=gpus, global_batch=32 * gpus, steps=5, tensorboard=False).save(config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
           "-m", "labkit", "run", str(config), "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "TMPDIR": str(root)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    run = labkit.load_run(run_dir)
    devices = [r["device"] for r in run.meta["ranks"]]
    assert devices == [f"cuda:{r}" for r in range(gpus)] and run.finished, run.meta
    assert run.df["cuda_peak_mb"].gt(0).all()
    return f"devices {devices}; cuda_peak_mb {run.df.groupby('rank')['cuda_peak_mb'].max().round(1).tolist()}"


@check("5. precision speed (one rank)")
def precision_speed(root: Path, rounds: int) -> str:
    base = RunConfig(world_size=1, model_size="base", global_batch=256, seq_len=128, steps=30, tensorboard=False,
                     save_final=False)
    speeds: dict[str, list[float]] = {p: [] for p in ("fp32", "bf16", "fp16")}
    for i in range(rounds):
        for p in (list(speeds) if i % 2 == 0 else list(speeds)[::-1]):
            run = labkit.launch(base.replace(precision=p), runs_root=root, echo=False, progress=False)
            speeds[p].append(run.summary()["median_samples_per_s"])
    median = {p: sorted(v)[len(v) // 2] for p, v in speeds.items()}
    return ", ".join(f"{p} {median[p]:.0f} samples/s ({median[p] / median['fp32']:.2f}x fp32)" for p in median) \
        + f"; tinylm base, 256 x 128 tokens per step, median of {rounds} rounds"


@check("6. NCCL all_reduce")
def nccl_busbw(gpus: int, root: Path) -> str:
    from labkit.tricks import comm
    df = comm.benchmark(ops=("all_reduce",), sizes=[64 * 2**20], world_size=gpus, repeats=20, warmup=5,
                        backend="nccl", runs_root=root)
    row = df.iloc[0]
    assert row["time_s"] > 0, row
    return f"64 MiB, world {gpus}: {row['time_s'] * 1e3:.2f} ms, busbw {row['busbw_GBps']:.1f} GB/s"


@check("7. fork guard")
def fork_guard(gpus: int, root: Path) -> str:
    torch.zeros(1, device="cuda")  # this line initialises CUDA here: the guard must name it
    try:
        labkit.launch(where_am_i, world_size=gpus, start_method="fork", runs_root=root, echo=False)
        raise AssertionError("fork was allowed with CUDA initialised")
    except LaunchError as exc:
        named = "gpu_check.py" in str(exc) and "torch.zeros(1, device=" in str(exc)
        assert named, f"the refusal does not name the line:\n{exc}"
    cfg = RunConfig(world_size=gpus, global_batch=32 * gpus, steps=5, tensorboard=False)
    run = labkit.launch(cfg, runs_root=root, echo=False, progress=False)  # auto: spawns
    assert run.meta["start_method"] == "spawn" and len(run.steps()) == 5
    spawn_s = run.summary()["time_to_first_step_s"]
    fork_s = MEASURED.get("fork_first_step_s", math.nan)
    return f"fork refused, naming the line; auto spawned and trained; first step: fork {fork_s:.2f} s, spawn {spawn_s:.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}): these checks "
              "need a machine with NVIDIA GPUs and a CUDA build of torch")
        return 1
    gpus = torch.cuda.device_count()  # counted without initialising CUDA here (names come from the ranks: check 2)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} GPU(s); labkit from "
          f"{Path(labkit.__file__).parent}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="labkit-gpu-check-"))
    backend_choice(gpus)
    ranks_on_gpus(gpus, root)
    training(gpus, root, 10 if args.quick else 30)
    under_torchrun(gpus, root)
    precision_speed(root, 1 if args.quick else 3)
    nccl_busbw(gpus, root)
    fork_guard(gpus, root)  # last: it initialises CUDA in this process
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed" + (f": {failed}" if failed else ""))
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
