"""Benchmark labkit's launcher: time to first step, and what the instrumented loop costs in throughput.

    .venv/bin/python bench/launch.py            # full: ~2-3 min on 2 CPU cores
    .venv/bin/python bench/launch.py --quick    # smaller: ~40 s

1. Startup: labkit.launch(...) call -> first recorded step, 2 ranks, tinylm. The first launch in the process is
   reported apart (cold: labkit's one-off warm imports of torch._dynamo/transformers/tensorboard happen there),
   then the median of later launches (warm), and one spawn launch for contrast. Target: warm < 0.5 s.
2. Instrumentation cost: labkit.train against `bare_ddp` below, the same model, data, DDP and optimizer with no
   records, loss all-reduce, grad norm or timing. Launches alternate (bare, labkit+TB, labkit-TB, ...) so machine
   noise hits all of them; medians and their ratios are reported. Target: labkit costs < 3% of throughput.
   The breakdown then adds ONE piece of labkit's instrumentation at a time to the bare loop.

All figures that matter are ratios measured in this run; absolute times are for orientation only.
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import labkit
from labkit.loop import make_optimizer, memory_fields
from labkit.tasks import make_task

WARMUP = 5          # steps left out of throughput (allocator, DDP bucket rebuild on the first backward)
STARTUP_TARGET_S = 0.5
OVERHEAD_TARGET = 0.03
PIECES = ("allreduce", "norm", "json", "json+tb", "statm")  # breakdown: each one added alone to the bare loop


def bare_ddp(ctx: Any, extras: frozenset[str] = frozenset()) -> None:
    """The work training needs and nothing else; `extras` adds single pieces of labkit's instrumentation.

    Per step it calls ctx.heartbeat(step) (one write to a shared-memory array, so the watchdog sees progress)
    and, once at the end, ctx.record(...) with the wall time of steps [WARMUP:]."""
    cfg = ctx.config
    torch.manual_seed(cfg.seed)
    task = make_task(cfg, ctx.world_size)
    model = task.build_model()
    ddp = DDP(model, bucket_cap_mb=cfg.bucket_cap_mb)
    optimizer = make_optimizer(cfg, model.parameters())
    started, inline, inline_cpu = time.perf_counter(), 0.0, 0.0
    for step in range(cfg.steps):
        if step == WARMUP:
            started, inline, inline_cpu = time.perf_counter(), 0.0, 0.0
        ctx.heartbeat(step)
        inputs, targets = task.batch(step, 0, ctx.rank)
        loss, _ = task.loss(ddp, inputs, targets)
        loss.backward()
        if extras:  # timed in-line too: wall, and CPU of the whole rank (all its threads; blind to other jobs)
            t0, c0 = time.perf_counter(), time.process_time()
            _extra_work(ctx, extras, model, loss, step, task.batch_size, task.tokens_per_sample)
            inline, inline_cpu = inline + time.perf_counter() - t0, inline_cpu + time.process_time() - c0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = cfg.steps - WARMUP
    ctx.record(cfg.steps, wall_s=time.perf_counter() - started, inline_s=inline / measured,
               inline_cpu_s=inline_cpu / measured,
               global_samples=cfg.global_batch * (cfg.steps - WARMUP))


def _extra_work(ctx: Any, extras: frozenset[str], model: torch.nn.Module, loss: torch.Tensor, step: int,
                batch: int, seq: int) -> None:
    """labkit.train's per-step extras, done as it does them (but the all-reduce is waited on at once, not
    overlapped with the optimizer step, so its in-line time includes waiting for the other rank)."""
    if "allreduce" in extras:
        loss_sum = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(loss_sum, async_op=True).wait()
        loss_sum.item()
    if "norm" in extras:
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
    if "statm" in extras:
        memory_fields(torch.device("cpu"))
    if {"json", "json+tb"} & extras:  # the record labkit writes: same fields (values made up), same count
        ctx.record(step, loss=loss.item(), loss_mean=1.0, lr=3e-3, grad_norm=1.0, samples=batch,
                   tokens=batch * seq, t_data=1e-3, t_fwd_bwd=1e-2, t_optim=1e-3, t_step=2e-2, rss_mb=400.0)


def launch(target: Any, cfg: labkit.RunConfig, root: str, **kw: Any) -> labkit.Run:
    return labkit.launch(target, world_size=cfg.world_size, config=cfg, runs_root=root, echo=False,
                         progress=False, **kw)


def measure(run: labkit.Run) -> dict[str, float]:
    """Global samples/s over steps [WARMUP:]. bare_ddp: from its one record per rank (the slower rank's wall).
    labkit: "per_step" is labkit's own figure (records.per_step: sum over steps of the slowest rank's t_step);
    "wall" is the slower rank's summed t_step, the same quantity bare_ddp measures."""
    df = run.df
    if "wall_s" in df and df["wall_s"].notna().any():
        done = df[df["wall_s"].notna()]
        samples = float(done["global_samples"].iloc[0])
        return {"": samples / done["wall_s"].max(), "inline_s": float(done["inline_s"].max()),
                "inline_cpu_s": float(done["inline_cpu_s"].max())}
    df = df[df["step"] >= WARMUP]
    samples = float(df["samples"].sum())
    return {" (per_step)": samples / df.groupby("step")["t_step"].max().sum(),
            " (wall)": samples / df.groupby("rank")["t_step"].sum().max()}


def startup(cfg: labkit.RunConfig, root: str, warm_runs: int) -> dict[str, float]:
    """Seconds from launch() to the first record: the cold first launch, warm launches (median), and spawn."""
    first = lambda **kw: launch(cfg, cfg, root, **kw).summary()["time_to_first_step_s"]  # noqa: E731
    cold = first()
    warm = [first() for _ in range(warm_runs)]
    return {"cold (1st launch)": cold, f"warm (median of {warm_runs})": statistics.median(warm),
            "warm (max)": max(warm), "spawn (1 launch)": first(start_method="spawn")}


Variants = dict[str, tuple[Callable[..., Any] | labkit.RunConfig, labkit.RunConfig]]


def alternate(variants: Variants, root: str, rounds: int) -> dict[str, list[float]]:
    """Every figure of each variant, launched in turn, `rounds` times over, so slow spells hit all alike."""
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, (target, cfg) in variants.items():
            for key, value in measure(launch(target, cfg, root)).items():
                out.setdefault(name + key, []).append(value)
    return out


def print_table(title: str, results: dict[str, list[float]], base: str, global_batch: int) -> dict[str, float]:
    """Median samples/s, spread, ratio to `base`, overhead; and a piece's in-line time as a share of a bare step.
    "best ratio" compares the fastest launches: on a shared machine the least disturbed one is the fastest."""
    med = {name: statistics.median(v) for name, v in results.items()}
    best = max(results[base])
    step_s = global_batch / med[base]  # one bare step, per rank
    print(f"\n{title}\n  {'variant':<32}{'samples/s':>10}{'spread':>8}{'ratio':>7}{'overhead':>9}"
          f"{'best ratio':>11}{'in-line/step: wall, cpu':>30}")
    for name, values in results.items():
        if name.endswith(("inline_s", "inline_cpu_s")):
            continue
        spread, ratio = (max(values) - min(values)) / med[name], med[name] / med[base]
        wall, cpu = med.get(name + "inline_s", 0.0), med.get(name + "inline_cpu_s", 0.0)
        cell = f"{wall * 1e6:5.0f} us {wall / step_s:5.1%}, {cpu * 1e6:5.0f} us {cpu / step_s:5.1%}" if wall else ""
        print(f"  {name:<32}{med[name]:>10.0f}{spread:>8.0%}{ratio:>7.3f}{1 - ratio:>9.1%}"
              f"{max(values) / best:>11.3f}{cell:>30}")
    return med


def check(label: str, cost: float) -> str:
    return f"  {label}: overhead {cost:.1%}, target < {OVERHEAD_TARGET:.0%}: " + \
        ("MET" if cost < OVERHEAD_TARGET else "NOT MET")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (~40 s)")
    args = parser.parse_args()
    steps, rounds, warm_runs = (30, 3, 3) if args.quick else (80, 5, 5)
    load = os.getloadavg()[0]  # other work on these 2 cores makes every ratio noisier: say so
    print(f"load average before: {load:.2f}" + ("  (busy machine: expect noisy ratios)" if load > 0.5 else ""))
    root = tempfile.mkdtemp(prefix="labkit-bench-")  # nothing lands in the repo
    try:
        t0 = time.perf_counter()
        start = startup(labkit.RunConfig(world_size=2, steps=3), root, warm_runs)
        print(f"\n1. launch() -> first recorded step, tinylm, 2 ranks (fork unless noted)\n  {'launch':<26}{'s':>8}")
        for name, seconds in start.items():
            print(f"  {name:<26}{seconds:>8.3f}")
        warm = start[f"warm (median of {warm_runs})"]
        print(f"  cold / warm = {start['cold (1st launch)'] / warm:.1f}x, spawn / warm = "
              f"{start['spawn (1 launch)'] / warm:.1f}x; target warm < {STARTUP_TARGET_S} s: "
              f"{'MET' if warm < STARTUP_TARGET_S else 'NOT MET'} ({warm / STARTUP_TARGET_S:.0%} of the budget)")

        cfg = labkit.RunConfig(world_size=2, steps=steps, tensorboard=False)
        tb = cfg.replace(tensorboard=True)
        med = print_table(f"2. throughput, steps {WARMUP}..{steps - 1}, {rounds} rounds alternated",
                          alternate({"bare DDP": (bare_ddp, cfg), "labkit, TensorBoard": (tb, tb),
                                     "labkit, no TB": (cfg, cfg)}, root, rounds), "bare DDP", cfg.global_batch)
        for name in ("labkit, TensorBoard", "labkit, no TB"):
            for how in (" (per_step)", " (wall)"):
                print(check(name + how, 1 - med[name + how] / med["bare DDP"]))
        for how in (" (per_step)", " (wall)"):
            print(f"  TensorBoard on / off{how} = {med['labkit, TensorBoard' + how] / med['labkit, no TB' + how]:.3f}")

        if not args.quick:  # which piece costs what: each added alone to the bare loop
            pieces: Variants = {"bare DDP": (bare_ddp, cfg)}
            pieces |= {f"bare + {p}": (functools.partial(bare_ddp, extras=frozenset({p})),
                                       tb if p == "json+tb" else cfg) for p in PIECES}
            print_table(f"3. breakdown: one piece of instrumentation at a time, {rounds} rounds alternated",
                        alternate(pieces, root, rounds), "bare DDP", cfg.global_batch)
        print(f"\n(total {time.perf_counter() - t0:.0f} s; load average after: {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
