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
7. FP8 GEMM (one rank, measured, not gated): torch._scaled_mm on E4M3 against a bf16 matmul at 8192^3 (--quick:
   4096^3), per-tensor and per-row scales, and DeepSeek-V3's 1 x 128 / 128 x 128 blocks where this torch and GPU
   run them; each result checked against labkit's simulation (training/fp8.py quantises, the GPU multiplies the
   dequantised values in fp32). What the CPU lesson (20) can only simulate. SKIP below compute capability 8.9.
7b. torchao's Float8Linear (one rank; SKIP without torchao, the fp8 extra): its tensorwise and rowwise recipes on
   one nn.Linear at size^2 x size, forward and backward, against labkit's simulation of the same recipe
   (RunConfig.fp8_engine's two sides, which lesson 20 finds equal on the CPU), and its bf16 forward + backward
   time against a bf16 nn.Linear's (eager, uncompiled: torchao's casts run as separate kernels).
8. the fork guard (it initialises CUDA here on purpose): start_method="fork" then raises LaunchError naming
   this file's line, "spawn" trains; seconds to the first step for fork (check 3) and spawn.
9. after CUDA, labkit's warm process: started before check 8 (forked from this process as `import labkit` forks it
   in a notebook, CUDA untouched), "auto" now forks the ranks from it: nccl on cuda:<rank>, records with
   cuda_peak_mb; seconds to the first step of two such launches against spawn's (check 8).
"""
from __future__ import annotations

import argparse
import functools
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
from labkit.run.session import resolve_backend  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


MEASURED: dict[str, Any] = {}  # what one check learns and a later one needs (the GPU's memory, fork's first step)


class Skipped(Exception):
    """A check this machine cannot run (not a failure): printed as SKIP with the reason."""


def check(name: str) -> Callable[[Callable[..., str]], Callable[..., None]]:
    """Run the decorated check; an AssertionError or any exception is a FAIL with its message, Skipped a SKIP (not
    counted as failed), else PASS."""
    def wrap(fn: Callable[..., str]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            started, cuda_before = time.perf_counter(), torch.cuda.is_initialized()
            try:
                detail, ok = fn(*args), True
            except Skipped as exc:
                detail, ok = f"SKIP: {exc}", True
            except Exception as exc:  # noqa: BLE001 - report and go on to the next check
                detail, ok = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}", False
            if torch.cuda.is_initialized() and not cuda_before and not name.startswith("8."):
                # This process must leave CUDA alone until check 8, or every launch after it has to spawn.
                detail, ok = f"{detail}\n(and it initialised CUDA in the checking process)", False
            RESULTS.append((name, ok, detail))
            verdict = "SKIP" if str(detail).startswith("SKIP") else "PASS" if ok else "FAIL"
            print(f"[{verdict}] {name} ({time.perf_counter() - started:.1f} s)\n    "
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
    from labkit.run.cuda_guard import fork_poisoned_by
    expected = "spawn" if fork_poisoned_by() else "fork"   # spawn once torchao is imported here (the fp8 extra)
    run = labkit.launch(where_am_i, world_size=gpus, runs_root=root, echo=False, progress=False)
    seen = [run.result(r) for r in range(gpus)]
    assert run.meta["start_method"] == expected, (run.meta["start_method"], expected)
    for r, s in enumerate(seen):
        assert s["backend"] == "nccl" and s["device"] == f"cuda:{r}" and s["current"] == r, (r, s)
        assert s["sum"] == gpus * (gpus + 1) / 2, (r, s)
    MEASURED["memory_mb"] = min(s["memory_mb"] for s in seen)
    return f"{expected}; {seen}"


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
    if gpus < 2:
        raise Skipped("one GPU: an all_reduce needs 2 ranks, and NCCL one GPU per rank")
    df = comm.benchmark(ops=("all_reduce",), sizes=[64 * 2**20], world_size=gpus, repeats=20, warmup=5,
                        backend="nccl", runs_root=root)
    row = df.iloc[0]
    assert row["time_s"] > 0, row
    return f"64 MiB, world {gpus}: {row['time_s'] * 1e3:.2f} ms, busbw {row['busbw_GBps']:.1f} GB/s"


def fp8_gemm(ctx: Any, size: int, repeats: int) -> dict:
    """In a rank (so that this process leaves CUDA alone): seconds per GEMM for bf16 and for torch._scaled_mm on
    E4M3 with each scaling this GPU runs, and each FP8 result's difference from labkit's simulation of it."""
    from labkit.training.fp8 import quantise
    capability = torch.cuda.get_device_capability(ctx.device)
    if capability < (8, 9):
        return {"skipped": f"compute capability {capability}: FP8 tensor cores need 8.9 (Ada) or 9.0 (Hopper) up"}
    g = torch.Generator(device=ctx.device).manual_seed(0)
    a, b = (torch.randn(size, size, device=ctx.device, generator=g) for _ in range(2))   # y = a @ b.T
    a16, b16 = a.bfloat16(), b.bfloat16()
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(ctx.device), "size": size,
                           "bf16_s": _gpu_seconds(lambda: a16 @ b16.t(), repeats)}
    kinds = {"tensor": ("tensor", "tensor"), "row": ("tile", "tile"), "block 1x128/128x128": ("tile", "block")}
    for name, (ka, kb) in kinds.items():
        qa = quantise(a, "e4m3", ka, size if name == "row" else 128)
        qb = quantise(b, "e4m3", kb, size if name == "row" else 128)
        fa, fb = qa.data.reshape(size, size), qb.data.reshape(size, size)
        simulated = qa.dequantise() @ qb.dequantise().t()
        out[name] = "not run here"
        for sa, sb in _scales(qa.scale, qb.scale, name, size):  # the layouts a scale tensor may need, in turn
            gemm = functools.partial(torch._scaled_mm, fa, fb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            try:
                y = gemm().float()
            except (RuntimeError, ValueError) as exc:  # torch refuses a scaling this build or GPU lacks
                out[name] = f"not run here: {str(exc).splitlines()[0][:160]}"
                continue
            off = ((y - simulated).norm() / simulated.norm()).item()
            out[name] = {"s": _gpu_seconds(gemm, repeats), "vs_simulation": off}
            if off < 1e-2:
                break
    return out


def _scales(sa: torch.Tensor, sb: torch.Tensor, name: str, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """labkit's scale tensors in the shapes torch._scaled_mm reads (b's transposed: it multiplies by b.T); for the
    blocks, a's [M, K/128] tiles both row-major and K-block-major (cuBLAS's layout), whichever this torch takes."""
    if name == "tensor":
        return [(sa.reshape(()), sb.reshape(()))]
    if name == "row":
        return [(sa.reshape(size, 1).contiguous(), sb.reshape(1, size).contiguous())]
    blocks = size // 128
    tiles, weight = sa.reshape(size, blocks).contiguous(), sb.reshape(blocks, blocks).t().contiguous()
    return [(tiles, weight), (tiles.t().contiguous().t(), weight)]


def _gpu_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of fn() on the GPU, by CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    start, end, times = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def in_one_rank(fn: Callable[..., dict], root: Path, **kwargs: Any) -> dict:
    """fn(ctx, **kwargs) in one rank (so that this process leaves CUDA alone), its result; Skipped where it said
    {"skipped": why}."""
    run = labkit.launch(functools.partial(fn, **kwargs), world_size=1, runs_root=root, echo=False, progress=False)
    got = run.result(0)
    if "skipped" in got:
        raise Skipped(got["skipped"])
    return got


@check("7. FP8 GEMM (one rank)")
def fp8_speed(root: Path, size: int, repeats: int) -> str:
    got = in_one_rank(fp8_gemm, root, size=size, repeats=repeats)
    flops, parts = 2 * size**3, [f"{got['gpu']}, {size}^3: bf16 {2 * size**3 / got['bf16_s'] / 1e12:.0f} TFLOP/s"]
    for name in ("tensor", "row", "block 1x128/128x128"):
        r = got[name]
        if isinstance(r, str):
            parts.append(f"e4m3 {name}: {r}")
            continue
        assert r["vs_simulation"] < 1e-2, (name, r)   # bf16 output rounding (2**-9) and accumulation order only
        parts.append(f"e4m3 {name}: {flops / r['s'] / 1e12:.0f} TFLOP/s ({got['bf16_s'] / r['s']:.2f}x bf16; "
                     f"{r['vs_simulation']:.1e} from labkit's simulation)")
    assert not isinstance(got["tensor"], str), got["tensor"]   # per-tensor FP8 runs on every FP8 GPU
    return "; ".join(parts)


def torchao_linear(ctx: Any, size: int, repeats: int) -> dict:
    """In a rank: per recipe, the relative gaps of y, dx, dW between torchao's Float8Linear and labkit's simulation
    (fp32 layer), and seconds per bf16 forward + backward for nn.Linear and for its Float8Linear."""
    import copy
    from labkit.constraints import torchao_available
    if not torchao_available():
        return {"skipped": "torchao is not installed (pip install 'labkit[fp8]')"}
    capability = torch.cuda.get_device_capability(ctx.device)
    if capability < (8, 9):
        return {"skipped": f"compute capability {capability}: FP8 tensor cores need 8.9 (Ada) or 9.0 (Hopper) up"}
    from torchao.float8 import convert_to_float8_training
    from labkit.training.fp8 import relative_error
    from labkit.training.fp8_layers import torchao_config
    from labkit.training.fp8_linear import Recipe, fp8_linear
    g = torch.Generator(device=ctx.device).manual_seed(0)
    x, dy = (torch.randn(size, size, device=ctx.device, generator=g) for _ in range(2))
    w = torch.randn(size, size, device=ctx.device, generator=g) / size**0.5
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(ctx.device), "size": size}
    for name, recipe in {"tensorwise": Recipe("tensor", 128, "e5m2"), "rowwise": Recipe("row", 128, "e4m3")}.items():
        layer = torch.nn.Linear(size, size, bias=False, device=ctx.device)
        with torch.no_grad():
            layer.weight.copy_(w)
        theirs = convert_to_float8_training(torch.nn.Sequential(layer), config=torchao_config(recipe))
        x1, x2, w2 = x.clone().requires_grad_(), x.clone().requires_grad_(), w.clone().requires_grad_()
        y1 = theirs(x1)
        y1.backward(dy)
        y2 = fp8_linear(x2, w2, None, recipe)
        y2.backward(dy)
        gaps = {k: relative_error(a, b) for k, a, b in (("y", y1, y2), ("dx", x1.grad, x2.grad),
                                                         ("dW", theirs[0].weight.grad, w2.grad))}
        plain = torch.nn.Linear(size, size, bias=False, device=ctx.device, dtype=torch.bfloat16)
        fp8 = convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(plain)), config=torchao_config(recipe))
        xb, dyb = x.bfloat16().requires_grad_(), dy.bfloat16()
        out[name] = {"gaps": gaps, "bf16_s": _gpu_seconds(lambda: plain(xb).backward(dyb), repeats),
                     "fp8_s": _gpu_seconds(lambda: fp8(xb).backward(dyb), repeats)}
    return out


@check("7b. torchao Float8Linear (one rank)")
def torchao_speed(root: Path, size: int, repeats: int) -> str:
    got = in_one_rank(torchao_linear, root, size=size, repeats=repeats)
    parts = [f"{got['gpu']}, Linear({got['size']}, {got['size']}) on {got['size']} tokens"]
    for name in ("tensorwise", "rowwise"):
        r = got[name]
        gaps = ", ".join(f"{k} {v:.1e}" for k, v in r["gaps"].items())
        parts.append(f"{name}: {gaps} from labkit's simulation; forward + backward {r['fp8_s'] * 1e3:.2f} ms vs "
                     f"bf16 {r['bf16_s'] * 1e3:.2f} ms ({r['bf16_s'] / r['fp8_s']:.2f}x, eager)")
        # fast accumulation in the forward GEMM and the GPU's summation order only (equal on the CPU: lesson 20)
        assert max(r["gaps"].values()) < 1e-2, (name, r["gaps"])
    return "; ".join(parts)


@check("8. fork guard")
def fork_guard(gpus: int, root: Path) -> str:
    torch.zeros(1, device="cuda")  # this line initialises CUDA here: the guard must name it
    try:
        labkit.launch(where_am_i, world_size=gpus, start_method="fork", runs_root=root, echo=False)
        raise AssertionError("fork was allowed with CUDA initialised")
    except LaunchError as exc:
        from labkit.run.cuda_guard import fork_poisoned_by
        named = "gpu_check.py" in str(exc) and "torch.zeros(1, device=" in str(exc)
        # with torchao installed, its import (through transformers) initialised CUDA first, and the refusal says so
        named = named or (fork_poisoned_by() is not None and "torchao" in str(exc))
        assert named, f"the refusal does not name the line:\n{exc}"
    cfg = RunConfig(world_size=gpus, global_batch=32 * gpus, steps=5, tensorboard=False)
    run = labkit.launch(cfg, runs_root=root, echo=False, progress=False, start_method="spawn")  # auto: check 9
    assert run.meta["start_method"] == "spawn" and len(run.steps()) == 5
    spawn_s = MEASURED["spawn_first_step_s"] = run.summary()["time_to_first_step_s"]
    fork_s = MEASURED.get("fork_first_step_s", math.nan)
    return f"fork refused, naming the line; auto spawned and trained; first step: fork {fork_s:.2f} s, spawn {spawn_s:.2f} s"


def warm_before_cuda() -> None:
    """Start labkit's warm process now, forked from this process while CUDA is untouched here, as `import labkit`
    does in a notebook (check 9 uses it once check 8 has initialised CUDA)."""
    from labkit.run import warm
    warm.start(afresh=False)


@check("9. warm process after CUDA")
def warm_after_cuda(gpus: int, root: Path) -> str:
    assert torch.cuda.is_initialized(), "check 8 should have initialised CUDA here"
    cfg = RunConfig(world_size=gpus, global_batch=32 * gpus, steps=5, tensorboard=False)
    runs = [labkit.launch(cfg, runs_root=root, echo=False, progress=False) for _ in range(2)]  # auto
    from labkit.run.cuda_guard import fork_poisoned_by
    expected = "spawn" if fork_poisoned_by() else "warm"   # torchao imported: no fork, not even from the warm process
    assert [r.meta["start_method"] for r in runs] == [expected] * 2, [r.meta["start_method"] for r in runs]
    for run in runs:
        devices = [r["device"] for r in run.meta.get("ranks", [])] or None
        assert len(run.steps()) == 5 and run.df["cuda_peak_mb"].gt(0).all(), (devices, run.df.columns.tolist())
    firsts = [r.summary()["time_to_first_step_s"] for r in runs]
    spawn_s = MEASURED.get("spawn_first_step_s", math.nan)
    how = "forked the ranks from the warm process" if expected == "warm" else "spawned the ranks (torchao installed)"
    return (f"auto {how}, on the GPUs (cuda_peak_mb "
            f"{runs[-1].df.groupby('rank')['cuda_peak_mb'].max().round(1).tolist()}); first step: warm "
            f"{firsts[0]:.2f} s, then {firsts[1]:.2f} s; spawn {spawn_s:.2f} s (check 8): "
            f"{firsts[1] / spawn_s:.2f}x")


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
    fp8_speed(root, 4096 if args.quick else 8192, 10 if args.quick else 30)
    torchao_speed(root, 4096 if args.quick else 8192, 10 if args.quick else 30)
    warm_before_cuda()      # forked now, while CUDA is untouched here (as import labkit does in a notebook)
    fork_guard(gpus, root)  # it initialises CUDA in this process
    warm_after_cuda(gpus, root)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed" + (f": {failed}" if failed else ""))
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
