"""Benchmark labkit's launcher: time to first step, and what the instrumented loop costs in throughput.

    .venv/bin/python bench/launch.py            # full: ~1.5 min on 2 idle CPU cores (more on a busy machine)
    .venv/bin/python bench/launch.py --quick    # fewer steps and rounds: ~30 s

1. Startup: labkit.launch(...) call -> first recorded step, 2 ranks, tinylm. The first launch in the process is
   reported apart (cold: labkit's one-off warm imports of torch._dynamo/transformers happen there), then the
   median of later launches (warm), and one spawn launch for contrast. Target: warm < 0.5 s.
2. Instrumentation cost: labkit.train against `bare_ddp` below (same model, data, DDP and optimizer; no records,
   grad norm or timing). Launches alternate (bare, labkit+TB, labkit-TB, ...) so machine noise hits all alike;
   medians and ratios are reported. Target: labkit costs < 3% of throughput. Measures over steps [WARMUP:]: total
   wall time of the slower rank; labkit's own figure (records.per_step: sum of the slowest rank's t_step); the
   median step's CPU time (mean rank); and the median over rounds of the total-wall ratio within a round.
   Other jobs on a shared machine come in bursts that can swamp wall-time medians (see the spread column); the
   per-step CPU time and the paired ratios are far less affected.
3. Breakdown: each piece of per-step instrumentation (as labkit.train had it when this bench was written) timed
   alone, back to back, inside a rank (median), as a share of a bare step's CPU time; "in loop" says whether
   labkit's per-step path still does it.

All figures that matter are ratios measured in this run; absolute times are for orientation only.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import labkit
from labkit.training.loop import make_optimizer, memory_fields
from labkit.records import RankRecorder
from labkit.training.tasks import make_task

WARMUP = 5          # steps left out of throughput (allocator, DDP bucket rebuild on the first backward)
REPS = 100          # times each piece is timed in the breakdown
STARTUP_TARGET_S, OVERHEAD_TARGET = 0.5, 0.03
Figures = dict[str, list[float]]  # one variant's figures (samples/s by each measure, ...), one value per round


def clocks() -> tuple[float, float]:
    """(wall, CPU of this whole rank: all its threads, so gloo's and any writer thread's count too)."""
    return time.perf_counter(), time.process_time()


def record_ends(ctx: Any, ends: list[tuple[float, float]]) -> None:
    """One record, after the last step: the clocks at the end of every step (step = config.steps)."""
    ctx.record(ctx.config.steps, end_wall=[e[0] for e in ends], end_cpu=[e[1] for e in ends])


def build(ctx: Any) -> tuple[Any, torch.nn.Module, DDP, torch.optim.Optimizer]:
    cfg = ctx.config
    torch.manual_seed(cfg.seed)
    task = make_task(cfg, ctx.world_size)
    model = task.build_model()
    return task, model, DDP(model, bucket_cap_mb=cfg.bucket_cap_mb), make_optimizer(cfg, model.parameters())


def bare_step(ctx: Any, task: Any, ddp: DDP, optimizer: torch.optim.Optimizer, step: int, zero: bool = True) -> Any:
    ctx.heartbeat(step)  # one write to a shared-memory array, so the watchdog sees progress
    inputs, targets = task.batch(step, 0, ctx.rank)
    loss, _ = task.loss(ddp, inputs, targets)
    loss.backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad(set_to_none=True)
    return loss


def bare_ddp(ctx: Any) -> None:
    """The work training needs and nothing else. It reads the clocks after each step (two clock reads, ~1 us, so
    medians can drop steps that other jobs preempted) and records them once, at the end."""
    task, _, ddp, optimizer = build(ctx)
    ends = [clocks()] * ctx.config.steps
    for step in range(ctx.config.steps):
        bare_step(ctx, task, ddp, optimizer, step)
        ends[step] = clocks()
    record_ends(ctx, ends)


def instrumented(ctx: Any) -> None:
    """labkit.train(ctx), what launch(RunConfig) runs, timed like bare_ddp: ctx.record is wrapped to read the
    clocks after each step's record (one Python call and two clock reads per step, as in bare_ddp)."""
    record, ends = ctx.record, list[tuple[float, float]]()

    def timed_record(step: int, **fields: Any) -> None:
        record(step, **fields)
        ends.append(clocks())

    ctx.record = timed_record
    labkit.train(ctx)
    ctx.record = record
    record_ends(ctx, ends)


def piece_costs(ctx: Any) -> dict[str, float]:
    """Median seconds of a bare step and of each instrumentation piece, timed REPS times on both ranks (in the
    same order: the all-reduce needs both). Medians, so moments when other jobs preempt a rank drop out."""
    task, model, ddp, optimizer = build(ctx)
    ends = [clocks()]
    for step in range(ctx.config.steps):
        loss = bare_step(ctx, task, ddp, optimizer, step, zero=step < ctx.config.steps - 1)  # keep the last grads
        ends.append(clocks())
    wall, cpu = (np.diff([e[i] for e in ends])[WARMUP:] for i in (0, 1))
    record = dict(step=0, time=time.time(), loss=1.0, lr=3e-3, grad_norm=1.0, samples=16, tokens=512,
                  t_data=1e-3, t_fwd_bwd=1e-2, t_optim=1e-3, t_step=2e-2, rss_mb=400.0)  # as labkit.train's
    from torch.utils.tensorboard import SummaryWriter  # here, not at the top: the cold launch must pay its imports
    (ctx.run_dir / "pieces").mkdir(exist_ok=True)
    json_lines = RankRecorder(ctx.run_dir / "pieces", ctx.rank)
    tb = SummaryWriter(log_dir=str(ctx.run_dir / "pieces" / f"tb{ctx.rank}"), flush_secs=5)  # as labkit had it

    def all_reduce() -> None:  # as train did it, but waited on at once instead of overlapping the optimizer
        loss_sum = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(loss_sum, async_op=True).wait()
        loss_sum.item()

    pieces: dict[str, Callable[[], Any]] = {
        "loss all-reduce": all_reduce,
        "get_total_norm": lambda: torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]).item(),
        "/proc/self/statm": lambda: memory_fields(torch.device("cpu")),
        "JSON record": lambda: json_lines.write(record),
        "TensorBoard add_scalar x10": lambda: [tb.add_scalar(k, v, 0) for k, v in list(record.items())[2:]]}
    out = {"bare step wall": float(np.median(wall)), "bare step CPU": float(np.median(cpu))}
    for name, piece in pieces.items():
        times = [0.0] * REPS
        for i in range(REPS):
            t0 = time.perf_counter()
            piece()
            times[i] = time.perf_counter() - t0
        out[name] = statistics.median(times)
    json_lines.close()
    tb.close()
    return out


def in_loop(piece: str) -> str:
    """Whether labkit's per-step path (train and RankRecorder.write) does this piece now (labkit changes)."""
    needle = {"loss all-reduce": "all_reduce(", "get_total_norm": "get_total_norm", "/proc/self/statm": "statm",
              "JSON record": "json.dumps", "TensorBoard add_scalar x10": "add_scalar"}[piece]
    return "yes" if needle in inspect.getsource(labkit.training.loop) + inspect.getsource(RankRecorder.write) else "no"


def launch(target: Any, cfg: labkit.RunConfig, root: str, **kw: Any) -> labkit.Run:
    return labkit.launch(target, world_size=cfg.world_size, config=cfg, runs_root=root, echo=False,
                         progress=False, **kw)


def measure(target: Any, cfg: labkit.RunConfig, root: str) -> dict[str, float]:
    """Global samples/s over steps [WARMUP:]: by total wall time (slower rank), by labkit's per_step figure and by
    the median step's CPU time (mean rank); and how long the launch() call took in all."""
    called = time.perf_counter()
    run = launch(target, cfg, root)
    df, samples = run.df, cfg.global_batch * (cfg.steps - WARMUP)
    ends = df[df["step"] == cfg.steps]
    wall, cpu = (np.array(ends[k].tolist()) for k in ("end_wall", "end_cpu"))  # [rank, step]
    step_cpu = np.diff(cpu)[:, WARMUP - 1:]  # steps WARMUP..: a step runs from the end of the one before
    out = {"wall": samples / (wall[:, -1] - wall[:, WARMUP - 1]).max(),
           "cpu": cfg.global_batch / np.median(step_cpu.mean(axis=0)), "launch_s": time.perf_counter() - called}
    if target is instrumented:
        steps = df[(df["step"] >= WARMUP) & (df["step"] < cfg.steps)]
        out["per_step"] = samples / steps.groupby("step")["t_step"].max().sum()
    return out


def alternate(variants: dict[str, tuple[Callable[..., Any], labkit.RunConfig]], root: str,
              rounds: int) -> dict[str, Figures]:
    """Every figure of each variant, launched in turn, `rounds` times over, so slow spells hit all alike."""
    out: dict[str, Figures] = {name: {} for name in variants}
    for _ in range(rounds):
        for name, (target, cfg) in variants.items():
            for key, value in measure(target, cfg, root).items():
                out[name].setdefault(key, []).append(value)
    return out


def report_startup(root: str, warm_runs: int) -> None:
    """Seconds from launch() to the first record: the cold first launch, warm launches (median), and spawn."""
    cfg = labkit.RunConfig(world_size=2, steps=3)
    first = lambda **kw: launch(cfg, cfg, root, **kw).summary()["time_to_first_step_s"]  # noqa: E731
    cold = first()  # must be the first launch in this process
    warm_all = [first() for _ in range(warm_runs)]
    spawn = first(start_method="spawn")
    warm = statistics.median(warm_all)
    print(f"\n1. launch() -> first recorded step, tinylm, 2 ranks, fork unless noted (s)\n"
          f"  cold (1st launch) {cold:.3f} | warm median of {warm_runs} {warm:.3f} (max {max(warm_all):.3f})"
          f" | spawn {spawn:.3f}\n  cold / warm = {cold / warm:.1f}x, spawn / warm = {spawn / warm:.1f}x; "
          f"target warm < {STARTUP_TARGET_S} s: {'MET' if warm < STARTUP_TARGET_S else 'NOT MET'} "
          f"(warm = {warm / STARTUP_TARGET_S:.0%} of the budget)")


def ratios(res: Figures, base: Figures) -> dict[str, float]:
    """Throughput of a variant over bare DDP's, four ways, each a median over rounds."""
    m, b = ({k: statistics.median(v) for k, v in r.items()} for r in (res, base))
    return {"total wall": m["wall"] / b["wall"], "per_step": m.get("per_step", math.nan) / b["wall"],
            "CPU/step": m["cpu"] / b["cpu"],
            "paired": statistics.median(v / b for v, b in zip(res["wall"], base["wall"]))}  # same round


def throughput(cfg: labkit.RunConfig, root: str, rounds: int) -> tuple[dict[str, Figures], dict[str, dict]]:
    """bare DDP, labkit with TensorBoard, labkit without, alternated: every figure, and the ratios to bare DDP."""
    tb = cfg.replace(tensorboard=True)
    res = alternate({"bare DDP": (bare_ddp, cfg), "labkit, TensorBoard": (instrumented, tb),
                     "labkit, no TB": (instrumented, cfg)}, root, rounds)
    return res, {name: ratios(r, res["bare DDP"]) for name, r in res.items()}


def overhead_rows(quick: bool = True) -> list[tuple[str, float, float, float, str]]:
    """Rows for bench/all.py, (what, labkit, bare DDP, ratio, target): labkit.train's samples/s against the bare
    DDP loop's, launched alternately; by the median step's CPU time, and by wall time paired within each round."""
    steps, rounds = (30, 4) if quick else (80, 7)
    root = tempfile.mkdtemp(prefix="labkit-bench-")
    try:
        res, table = throughput(labkit.RunConfig(world_size=2, steps=steps, tensorboard=False), root, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in res.items()}
    ours, bare, target = med["labkit, TensorBoard"], med["bare DDP"], f">= {1 - OVERHEAD_TARGET:.2f}"
    return [("loop samples/s by CPU per step: labkit.train / bare DDP", ours["cpu"], bare["cpu"],
             table["labkit, TensorBoard"]["CPU/step"], target),
            (f"loop samples/s by wall, paired in {rounds} rounds: same", ours["wall"], bare["wall"],
             table["labkit, TensorBoard"]["paired"], target)]


def report_throughput(cfg: labkit.RunConfig, root: str, rounds: int) -> None:
    res, table = throughput(cfg, root, rounds)
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in res.items()}
    print(f"\n2. throughput, steps {WARMUP}..{cfg.steps - 1}, {rounds} rounds alternated; ratios to bare DDP\n"
          f"  {'variant':<20}{'samples/s':>10}{'spread':>8}" + "".join(f"{k:>12}" for k in table["bare DDP"])
          + f"{'launch s':>10}")
    for name, row in table.items():
        spread = (max(res[name]["wall"]) - min(res[name]["wall"])) / med[name]["wall"]
        cells = "".join(" " * 12 if math.isnan(v) else f"{v:>12.3f}" for v in row.values())
        print(f"  {name:<20}{med[name]['wall']:>10.0f}{spread:>8.0%}{cells}{med[name]['launch_s']:>10.2f}")
    for name in ("labkit, TensorBoard", "labkit, no TB"):  # overhead = 1 - ratio
        print(f"  {name}, overhead (target < {OVERHEAD_TARGET:.0%}): " + ", ".join(
            f"{k} {1 - v:.1%} {'MET' if 1 - v < OVERHEAD_TARGET else 'NOT MET'}" for k, v in table[name].items()))
    on, off = table["labkit, TensorBoard"], table["labkit, no TB"]
    print("  TensorBoard on / off: " + ", ".join(f"{k} {on[k] / off[k]:.3f}" for k in on) + "; the launch() call "
          f"takes {med['labkit, TensorBoard']['launch_s'] / med['labkit, no TB']['launch_s']:.2f}x as long")


def report_pieces(cfg: labkit.RunConfig, root: str) -> None:
    """What each piece of instrumentation costs per step, as a share of a bare step (rank 0's medians)."""
    costs = launch(piece_costs, cfg, root).result(0)
    wall, step = costs.pop("bare step wall"), costs.pop("bare step CPU")
    # Share of the step's CPU time: what a step takes when the rank has a core to itself (the wall time also
    # holds the time other jobs took the core; the pieces, a few us each, are rarely preempted).
    print(f"\n3. breakdown: each piece timed alone {REPS}x on both ranks (median), as a share of a bare step's "
          f"CPU time\n   (median step: CPU {step * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms)\n"
          f"  {'piece':<28}{'us':>8}{'of a step':>11}{'in loop':>9}")
    for name, seconds in costs.items():
        print(f"  {name:<28}{seconds * 1e6:>8.0f}{seconds / step:>11.2%}{in_loop(name):>9}")
    now = sum(s for name, s in costs.items() if in_loop(name) == "yes")
    print(f"  pieces in labkit's loop now: {now / step:.2%} of a step; all five: {sum(costs.values()) / step:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (~40 s)")
    args = parser.parse_args()
    steps, rounds, warm_runs = (30, 4, 3) if args.quick else (80, 7, 5)
    load = os.getloadavg()[0]  # other work on these 2 cores makes wall-time ratios noisier: say so
    print(f"load average before: {load:.2f}" + ("  (busy: trust CPU/step, paired, section 3)" if load > 0.5 else ""))
    root, t0 = tempfile.mkdtemp(prefix="labkit-bench-"), time.perf_counter()  # nothing lands in the repo
    try:
        report_startup(root, warm_runs)
        cfg = labkit.RunConfig(world_size=2, steps=steps, tensorboard=False)
        report_throughput(cfg, root, rounds)
        report_pieces(cfg.replace(steps=WARMUP + 20), root)
        print(f"\n(total {time.perf_counter() - t0:.0f} s; load average after: {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
