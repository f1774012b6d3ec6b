"""Benchmark labkit's launcher: time to first step, and what the instrumented loop costs in throughput.

    .venv/bin/python bench/launch.py            # full: ~4 min on 2 CPU cores (more on a busy machine)
    .venv/bin/python bench/launch.py --quick    # fewer steps and rounds: ~2 min
    .venv/bin/python bench/launch.py --quick --only throughput,profile

1. Startup: labkit.launch(...) call -> first recorded step, 2 ranks, tinylm. The first launch in the process is
   reported apart (cold: labkit's one-off warm imports of torch._dynamo/transformers happen there), then the
   median of later launches (warm), and one spawn launch for contrast. Target: warm < 0.5 s.
2. Instrumentation cost: labkit.train against `bare_ddp` below (same model, data, DDP and optimizer; no records,
   grad norm or timing), both launched by labkit.launch. Launches alternate (bare, labkit, then labkit, bare, ...),
   each pinned to the same cores (labkit.measure.pinned_to) with a CpuMeter on them, after waiting (at most 5 s)
   for other programs to leave them. Per round: the median step's CPU time (mean rank) of bare DDP over labkit's.
   Those per-round ratios alternate with the order (on this machine the launch that goes second in a round was
   ~10% slower per step than the first, whichever variant it was: 0.92, 1.12, 0.88, 1.09, ...), so a median of
   rounds swung from run to run (0.94, then 1.08) by how the middle rounds fell. The figure that decides pairs
   each round with the next, reversed one (A B then B A: each variant once in each position) and takes the
   geometric mean of the two, which cancels the position; then the median of those blocks (target >= 0.97: labkit
   costs < 3%).
   Also printed: total wall time (slower rank), labkit's own per_step figure, the ratio of the 20th-percentile
   steps, and the cores other programs kept busy ("others"): on a shared machine the rounds spread by several
   percent, and only the median of many paired rounds means anything.
3. Breakdown: each piece of per-step instrumentation (as labkit.train had it when this bench was written) timed
   alone, back to back, inside a rank (median), as a share of a bare step's CPU time; "in loop" says whether
   labkit's per-step path still does it.

4. Profile: labkit.train under cProfile in rank 0: the calls its loop makes once a step or more, ms per step and
   share (upper bounds: cProfile's own cost inflates Python-heavy calls), and inside optimizer_step.

All figures that matter are ratios measured in this run; absolute times are for orientation only.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import random
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
from labkit.training.loop import memory_fields
from labkit.training.optim import make_optimizer
from labkit.measure import CpuMeter, pinned_to, usable_cores
from labkit.measure.cores import wait_for_quiet
from labkit.records import RankRecorder
from labkit.training.tasks import make_task

WARMUP = 5          # steps left out of throughput (allocator, DDP bucket rebuild on the first backward)
# Steps per launch and rounds (one launch of each variant per round; an even number: blocks of two, A B then B A).
LOW_QUANTILE = 0.2
QUIET_CORES, QUIET_WAIT_S = 0.25, 5.0  # before each launch, wait (at most 5 s) for other programs to leave the cores
STEPS_QUICK, ROUNDS_QUICK, STEPS_FULL, ROUNDS_FULL = 40, 24, 60, 40
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
           "cpu": cfg.global_batch / np.median(step_cpu.mean(axis=0)), "launch_s": time.perf_counter() - called,
           "cpu_low": cfg.global_batch / np.quantile(step_cpu, LOW_QUANTILE, axis=1).mean()}
    if target is instrumented:
        steps = df[(df["step"] >= WARMUP) & (df["step"] < cfg.steps)]
        out["per_step"] = samples / steps.groupby("step")["t_step"].max().sum()
    return out


def alternate(variants: dict[str, tuple[Callable[..., Any], labkit.RunConfig]], root: str,
              rounds: int) -> dict[str, Figures]:
    """Every figure of each variant, `rounds` times over, the order reversed every other round (A B, B A, ...) so
    that slow spells hit all alike; each block of two rounds runs back to back, after waiting for quiet cores. Every launch runs pinned to the same cores (measure.pinned_to: its ranks inherit
    them) with a meter on those cores: "others" is the cores other programs kept busy during its steps."""
    out: dict[str, Figures] = {name: {} for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            target, cfg = variants[name]
            cores = min(cfg.world_size, usable_cores())
            if r % 2 == 0 and name == names[0]:
                wait_for_quiet(cores, QUIET_CORES, QUIET_WAIT_S)  # before a block: its four launches back to back
            with pinned_to(cores), CpuMeter() as meter:
                started = time.time()
                figures = measure(target, cfg, root)
                figures["others"] = meter.cores_busy(started, time.time())[1]
            for key, value in figures.items():
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
            "paired": statistics.median(v / b for v, b in zip(res["wall"], base["wall"])),  # same round
            "CPU/step paired": statistics.median(blocks(paired_cpu(res, base)))}


def interval(values: list[float], level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval for the median of `values` (seeded: the same values give the same interval): how far
    the figure that decides could move if the benchmark were run again on this machine."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int((1 - level) / 2 * resamples)], medians[int((1 + level) / 2 * resamples) - 1]


def blocks(per_round: list[float]) -> list[float]:
    """Rounds 2k and 2k+1 (A B, then B A) as one figure, the geometric mean of their ratios: each variant ran once
    first and once second, so what the position in a round does cancels."""
    return [math.sqrt(a * b) for a, b in zip(per_round[::2], per_round[1::2])]


def paired_cpu(res: Figures, base: Figures) -> list[float]:
    """Per round, a variant's samples/s by CPU per step over bare DDP's in the same round (drift cancels)."""
    return [v / b for v, b in zip(res["cpu"], base["cpu"])]


def throughput(cfg: labkit.RunConfig, root: str, rounds: int) -> tuple[dict[str, Figures], dict[str, dict]]:
    """bare DDP and labkit.train, alternated on pinned cores: every figure, and the ratios to bare DDP."""
    res = alternate({"bare DDP": (bare_ddp, cfg), "labkit.train": (instrumented, cfg)}, root, rounds)
    return res, {name: ratios(r, res["bare DDP"]) for name, r in res.items()}


def overhead_rows(quick: bool = True) -> list[tuple[str, float, float, float, str]]:
    """Rows for bench/all.py, (what, labkit, bare DDP, ratio, target): labkit.train's samples/s against the bare
    DDP loop's, launched alternately on pinned cores, by CPU per step in blocks of two reversed rounds (the figure
    that decides), by wall time likewise; and where a step's time goes besides the work (cProfile)."""
    steps, rounds = (STEPS_QUICK, ROUNDS_QUICK) if quick else (STEPS_FULL, ROUNDS_FULL)
    root = tempfile.mkdtemp(prefix="labkit-bench-")
    try:
        cfg = labkit.RunConfig(world_size=2, steps=steps, tensorboard=False)
        res = alternate({"bare DDP": (bare_ddp, cfg), "labkit.train": (instrumented, cfg)}, root, rounds)
        profile = launch(profiled, cfg.replace(steps=60), root).result(0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = ratios(res["labkit.train"], res["bare DDP"])
    ours, bare = ({k: statistics.median(v) for k, v in res[n].items()} for n in ("labkit.train", "bare DDP"))
    per_block = sorted(blocks(paired_cpu(res["labkit.train"], res["bare DDP"])))
    wall_blocks = blocks([v / b for v, b in zip(res["labkit.train"]["wall"], res["bare DDP"]["wall"])])
    target = f">= {1 - OVERHEAD_TARGET:.2f}"
    total = sum(profile["train"].values())
    extra = sum(s for n, s in profile["train"].items() if not n.startswith(WORK))
    top = max(((n, s) for n, s in profile["train"].items() if not n.startswith(WORK)), key=lambda kv: kv[1],
              default=("none", 0.0))
    low, high = interval(per_block)
    return [(f"loop samples/s by CPU per step, median of {len(per_block)} blocks of 2 reversed rounds (90% "
             f"bootstrap interval {low:.3f}-{high:.3f}): labkit.train / bare DDP", ours["cpu"], bare["cpu"],
             table["CPU/step paired"], target),
            (f"loop samples/s by wall, {len(wall_blocks)} blocks likewise: same", ours["wall"], bare["wall"],
             statistics.median(wall_blocks), target),
            (f"  where it goes (cProfile, an upper bound): ms/step besides forward+backward and the optimizer step "
             f"/ a step's; most: {top[0].split(' (')[0]} {top[1] * 1e3:.2f} ms", extra * 1e3, total * 1e3,
             extra / total, f"<= {OVERHEAD_TARGET}")]


def quartiles(values: list[float]) -> str:
    """The first and third quartiles, "0.97-0.99": how far the rounds spread around their median."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{q[0]:.2f}-{q[2]:.2f}"


def report_throughput(cfg: labkit.RunConfig, root: str, rounds: int) -> None:
    res, table = throughput(cfg, root, rounds)
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in res.items()}
    print(f"\n2. throughput, steps {WARMUP}..{cfg.steps - 1}, {rounds} rounds alternated on pinned cores; ratios to "
          f"bare DDP\n  {'variant':<14}{'samples/s':>10}{'spread':>8}" + "".join(f"{k:>16}" for k in table["bare DDP"])
          + f"{'launch s':>10}{'others':>8}")
    for name, row in table.items():
        spread = (max(res[name]["wall"]) - min(res[name]["wall"])) / med[name]["wall"]
        cells = "".join(" " * 16 if math.isnan(v) else f"{v:>16.3f}" for v in row.values())
        print(f"  {name:<14}{med[name]['wall']:>10.0f}{spread:>8.0%}{cells}{med[name]['launch_s']:>10.2f}"
              f"{med[name]['others']:>8.2f}")
    per_round = paired_cpu(res["labkit.train"], res["bare DDP"])
    per_block = blocks(per_round)
    print("  CPU/step ratio per block of two reversed rounds: " + " ".join(f"{v:.3f}" for v in per_block)
          + "  (90%% bootstrap interval of their median: %.3f-%.3f)" % interval(per_block))
    low = [v / b for v, b in zip(res["labkit.train"]["cpu_low"], res["bare DDP"]["cpu_low"])]
    print("  low-quantile CPU/step ratio per round: " + " ".join(f"{v:.3f}" for v in low)
          + f"  (middle half {quartiles(sorted(low))}, median {statistics.median(low):.3f})")
    print("  CPU/step ratio per round: " + " ".join(f"{v:.3f}" for v in per_round)
          + f"  (middle half {quartiles(sorted(per_round))})")
    ratio = table["labkit.train"]["CPU/step paired"]
    print(f"  labkit.train overhead by CPU/step, paired: {1 - ratio:.1%} (target < {OVERHEAD_TARGET:.0%}: "
          f"{'MET' if 1 - ratio < OVERHEAD_TARGET else 'NOT MET'}); 'others': cores other programs kept busy")


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


def profiled(ctx: Any) -> dict[str, Any] | None:
    """labkit.train(ctx) under cProfile; rank 0 returns the seconds per step of each call that train's loop and
    optimizer_step make once a step or more (cumulative, through that caller only). One-off calls (set-up, the
    final save) are left out, so this is the steady step (the first steps, slower, are in it: run enough steps)."""
    import cProfile
    import pstats
    profile, steps = cProfile.Profile(), ctx.config.steps
    profile.runcall(labkit.train, ctx)
    if ctx.rank:
        return None
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}

    def calls_from(name: str, file_end: str) -> dict[str, float]:
        caller = next(f for f in stats if f[2] == name and f[0].endswith(file_end))
        out = {}
        for func, (_, _, _, _, callers) in stats.items():
            calls, _, _, cumtime = callers.get(caller, (0, 0, 0.0, 0.0))  # func's calls from `caller` only
            if calls >= steps:
                where = func[0].split("/labkit/")[-1] if "/labkit/" in func[0] else func[0].rsplit("/", 1)[-1]
                out[f"{func[2]} ({where}:{func[1]})"] = cumtime / steps
        return out

    return {"train": calls_from("train", "loop.py"), "optimizer_step": calls_from("optimizer_step", "nonfinite.py")}


# What bare_ddp's step does too (the work itself): everything else train's loop calls is instrumentation or features.
WORK = ("_forward_backward", "optimizer_step")


def report_profile(cfg: labkit.RunConfig, root: str, top: int = 10) -> None:
    """Where labkit.train's steady step goes, by cProfile in rank 0: the calls train's loop makes, ms per step."""
    out = launch(profiled, cfg, root).result(0)
    train = sorted(out["train"].items(), key=lambda kv: -kv[1])
    total = sum(out["train"].values())
    print(f"\n4. profile: labkit.train under cProfile, rank 0, {cfg.steps} steps: {total * 1e3:.2f} ms "
          f"per step in the calls its loop makes\n   (cProfile's own cost inflates Python-heavy calls: shares are "
          f"upper bounds)\n  {'call from train':<64}{'ms/step':>9}{'share':>8}")
    for name, seconds in train[:top]:
        print(f"  {name:<64}{seconds * 1e3:>9.3f}{seconds / total:>8.1%}")
    extra = sum(s for n, s in train if not n.startswith(WORK))
    print(f"  every call but {' and '.join(WORK)}: {extra * 1e3:.3f} ms, {extra / total:.1%} of a step")
    print(f"  {'inside optimizer_step':<64}")
    for name, seconds in sorted(out["optimizer_step"].items(), key=lambda kv: -kv[1])[:6]:
        print(f"    {name:<62}{seconds * 1e3:>9.3f}{seconds / total:>8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (~40 s)")
    parser.add_argument("--only", default="startup,throughput,pieces,profile",
                        help="comma-separated sections: startup, throughput, pieces, profile")
    args = parser.parse_args()
    only = args.only.split(",")
    steps, rounds, warm_runs = (STEPS_QUICK, ROUNDS_QUICK, 3) if args.quick else (STEPS_FULL, ROUNDS_FULL, 5)
    load = os.getloadavg()[0]  # other work on these 2 cores makes wall-time ratios noisier: say so
    print(f"load average before: {load:.2f}" + ("  (busy: trust CPU/step, paired, section 3)" if load > 0.5 else ""))
    root, t0 = tempfile.mkdtemp(prefix="labkit-bench-"), time.perf_counter()  # nothing lands in the repo
    try:
        if "startup" in only:
            report_startup(root, warm_runs)
        cfg = labkit.RunConfig(world_size=2, steps=steps, tensorboard=False)
        if "throughput" in only:
            report_throughput(cfg, root, rounds)
        if "pieces" in only:
            report_pieces(cfg.replace(steps=WARMUP + 20), root)
        if "profile" in only:
            report_profile(cfg.replace(steps=60), root)
        print(f"\n(total {time.perf_counter() - t0:.0f} s; load average after: {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
