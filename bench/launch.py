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
    started = time.perf_counter()
    for step in range(cfg.steps):
        if step == WARMUP:
            started = time.perf_counter()
        ctx.heartbeat(step)
        inputs, targets = task.batch(step, 0, ctx.rank)
        loss, _ = task.loss(ddp, inputs, targets)
        loss.backward()
        fields = _extra_work(extras, model, loss) if extras else {}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if {"json", "json+tb"} & extras:  # the record labkit writes: same fields, same count
            ctx.record(step, loss=loss.item(), loss_mean=0.0, lr=cfg.lr, grad_norm=0.0, samples=task.batch_size,
                       tokens=task.batch_size * task.tokens_per_sample, t_data=0.0, t_fwd_bwd=0.0, t_optim=0.0,
                       t_step=0.0, **fields)
    ctx.record(cfg.steps, wall_s=time.perf_counter() - started, global_samples=cfg.global_batch * (cfg.steps - WARMUP))


def _extra_work(extras: frozenset[str], model: torch.nn.Module, loss: torch.Tensor) -> dict[str, float]:
    """labkit.train's per-step extras, as it does them (the all-reduce is waited on here, not overlapped)."""
    if "allreduce" in extras:
        loss_sum = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(loss_sum, async_op=True).wait()
        loss_sum.item()
    if "norm" in extras:
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
    return memory_fields(torch.device("cpu")) if "statm" in extras else {}


def launch(target: Any, cfg: labkit.RunConfig, root: str, **kw: Any) -> labkit.Run:
    return labkit.launch(target, world_size=cfg.world_size, config=cfg, runs_root=root, echo=False,
                         progress=False, **kw)


def throughput(run: labkit.Run) -> float:
    """Global samples/s over steps [WARMUP:]: from bare_ddp's one record, or labkit's per-step t_step."""
    df = run.df
    if "wall_s" in df and df["wall_s"].notna().any():
        done = df[df["wall_s"].notna()]
        return float(done["global_samples"].iloc[0] / done["wall_s"].max())  # a step ends with its slowest rank
    steps = df[df["step"] >= WARMUP].groupby("step")
    return float(steps["samples"].sum().sum() / steps["t_step"].max().sum())


def startup(cfg: labkit.RunConfig, root: str, warm_runs: int) -> dict[str, float]:
    """Seconds from launch() to the first record: the cold first launch, warm launches (median), and spawn."""
    first = lambda **kw: launch(cfg, cfg, root, **kw).summary()["time_to_first_step_s"]  # noqa: E731
    cold = first()
    warm = [first() for _ in range(warm_runs)]
    return {"cold (1st launch)": cold, f"warm (median of {warm_runs})": statistics.median(warm),
            "warm (max)": max(warm), "spawn (1 launch)": first(start_method="spawn")}


def alternate(variants: dict[str, tuple[Callable[..., Any] | labkit.RunConfig, labkit.RunConfig]], root: str,
              rounds: int) -> dict[str, list[float]]:
    """Throughput of each variant, launched in turn, `rounds` times over, so slow spells hit all alike."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (target, cfg) in variants.items():
            out[name].append(throughput(launch(target, cfg, root)))
    return out


def print_table(title: str, results: dict[str, list[float]], base: str) -> dict[str, float]:
    """Median samples/s of each variant, its ratio to `base`, and the overhead in percent."""
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"\n{title}\n  {'variant':<26}{'samples/s (median)':>20}{'spread':>9}{'ratio':>8}{'overhead':>10}")
    for name, values in results.items():
        spread = (max(values) - min(values)) / med[name]
        ratio = med[name] / med[base]
        print(f"  {name:<26}{med[name]:>20.0f}{spread:>8.1%}{ratio:>8.3f}{1 - ratio:>10.1%}")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (~40 s)")
    args = parser.parse_args()
    steps, rounds, warm_runs = (20, 3, 3) if args.quick else (60, 5, 5)
    root = tempfile.mkdtemp(prefix="labkit-bench-")  # nothing lands in the repo
    try:
        t0 = time.perf_counter()
        start = startup(labkit.RunConfig(world_size=2, steps=3), root, warm_runs)
        print(f"1. launch() -> first recorded step, tinylm, 2 ranks (fork unless noted)\n  {'launch':<26}{'s':>8}")
        for name, seconds in start.items():
            print(f"  {name:<26}{seconds:>8.3f}")
        warm = start[f"warm (median of {warm_runs})"]
        print(f"  cold / warm = {start['cold (1st launch)'] / warm:.1f}x, spawn / warm = "
              f"{start['spawn (1 launch)'] / warm:.1f}x; target warm < {STARTUP_TARGET_S} s: "
              f"{'MET' if warm < STARTUP_TARGET_S else 'NOT MET'} ({warm / STARTUP_TARGET_S:.0%} of the budget)")

        cfg = labkit.RunConfig(world_size=2, steps=steps, tensorboard=False)
        tb = cfg.replace(tensorboard=True)
        med = print_table(f"2. throughput, steps {WARMUP}..{steps - 1}, {rounds} rounds alternated",
                          alternate({"bare DDP": (bare_ddp, cfg), "labkit.train, TensorBoard": (tb, tb),
                                     "labkit.train, no TB": (cfg, cfg)}, root, rounds), "bare DDP")
        for name in ("labkit.train, TensorBoard", "labkit.train, no TB"):
            cost = 1 - med[name] / med["bare DDP"]
            print(f"  {name}: instrumented/bare = {1 - cost:.3f}, overhead {cost:.1%}; target < "
                  f"{OVERHEAD_TARGET:.0%}: {'MET' if cost < OVERHEAD_TARGET else 'NOT MET'}")
        print(f"  TensorBoard on / off = {med['labkit.train, TensorBoard'] / med['labkit.train, no TB']:.3f}")

        if not args.quick:  # which piece costs what: each added alone to the bare loop
            pieces = {"bare DDP": (bare_ddp, cfg)}
            pieces |= {f"bare + {p}": (functools.partial(bare_ddp, extras=frozenset({p})),
                                       tb if p == "json+tb" else cfg) for p in PIECES}
            print_table(f"3. breakdown: one piece of instrumentation at a time, {rounds} rounds alternated",
                        alternate(pieces, root, rounds), "bare DDP")
        print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
