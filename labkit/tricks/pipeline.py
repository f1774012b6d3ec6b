"""Pipeline parallelism, measured: each rank's timeline, its bubble, the activations it holds, the messages it sends.

    from labkit.tricks import pipeline as pp
    run = pp.run_pipeline(pp.lesson_config("GPipe", microbatches=4))   # each rank pinned to a core of its own
    pp.bubble(run)                      # idle / makespan, per rank, median over the steady steps (measured)
    pp.summary(run)                     # the slowest stage's bubble, its idle between actions, the message wait...
    pp.bubble_table(runs)               # one row per run: those, with the formula to set beside them
    pp.gpipe_bubble(2, 4)               # (p - 1) / (m + p - 1): the formula
    pp.held(run)                        # {stage: (microbatches in flight at most, bytes autograd saved for them)}
    pp.messages(run)                    # point-to-point sends and bytes per step on each rank (counted)
    pp.timeline([run, ...])             # a figure: each rank's F / B / I / W actions as they ran
    pp.messages_as_placed(run)          # each rank's sends and receives against what the stages' placement implies
    pp.parameter_shares(run)            # each rank's share of the model's parameters, and the copies in all
    pp.trace_timeline(run)              # a step run under torch.profiler (RunConfig.profile_step), from its traces
    pp.match_stage_trace(pp.read_stage_trace(run.dir.trace(0)), pp.step_actions(run, step)[0])  # same actions?
    pp.bubbles_follow_the_formula(sweep)   # gated checks (they assert): the bubble against its formula, ...

The pipeline's traps (a hang, an abort, a rank without numpy), run and named by stage: pipeline_traps.

Definitions used throughout (labkit/training/parallel/pipetrace.py): the makespan of a step runs from its first
action's start on any rank to its last action's end on any rank; a rank's bubble is the part of it in which that
rank was not computing. Waiting for a peer's activations or gradients is idle, as is the time the messages take.
The pipeline's bubble is its slowest stage's (the rank that computed longest sets the pace; a faster one idles
more, by the stage imbalance, shown beside it).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import pandas as pd
import torch.distributed.pipelining  # noqa: F401 - imported once here, so forked ranks start with it
from matplotlib.figure import Figure

from ..config import RunConfig, V_SCHEDULES
from ..measure import CpuMeter, above, below, pin_rank, pinned_to, usable_cores
from ..records import Run
from ..run.launch import launch
from ..training.loop import train
from ..training.tasks import make_task
from ..training.parallel.pipetrace import (bubble_fractions, gpipe_bubble, in_flight, interleaved_bubble,
                                           message_waits, step_summary)
from ..training.parallel.strategies import COUNTED_STEPS
from ..view import COLORS, new_figure, shown
from .pipeline_trace import (KIND_COLORS, PipelineTrace, match_stage_trace, read_stage_trace, step_actions,
                             trace_timeline)

__all__ = ["Sweep", "lesson_config", "run_pipeline", "pinned_train", "bubble", "bubbles", "summary", "formula", "held",
           "messages", "timeline", "gpipe_bubble", "interleaved_bubble", "bubble_table", "their_models",
           "message_waits", "placement", "messages_as_placed", "parameter_shares",
           "messages_wait_little", "bubbles_follow_the_formula", "ramp_follows_the_interleaved_formula",
           "interleaving_idles_more_between_actions", "BubbleBelow1F1B", "TOLERANCE", "step_actions",
           "read_stage_trace", "match_stage_trace", "trace_timeline", "PipelineTrace"]

STEADY_FROM = COUNTED_STEPS  # steps 0..2 infer shapes, check gradients and count messages at the dispatcher
# (which slows every op): the bubble is read from the steps after them
LOOPED_FORMULA = ("Interleaved1F1B", "LoopedBFS")  # (p-1)/(v m + p-1): the ramp, in chunks of 1/v, paid once
TOLERANCE = 0.10  # of the step, between a measured bubble and its formula: what the formula leaves out (the time
# between actions, stages not exactly equal) stays under it on quiet cores


def lesson_config(schedule: str = "GPipe", *, microbatches: int = 4, world_size: int = 2, **fields: Any) -> RunConfig:
    """The lesson's pipeline: tinylm's small GPT-2 (width 128), 4 blocks, 64 samples of 32 tokens per step:
    lesson_config("1F1B", microbatches=8). Sized so that at 4 microbatches a stage's forward of one microbatch is
    well above what a message between the ranks waits, or the bubble measured would be mostly messages: summary(run)
    measures both, and lesson 18 asserts their ratio where it compares a bubble with its formula."""
    v = 2 if schedule in V_SCHEDULES or schedule not in ("GPipe", "1F1B") else 1
    base = {"task": "tinylm", "strategy": "pp", "world_size": world_size, "model_size": "small", "layers": 4,
            "global_batch": 64,
            "seq_len": 32, "microbatches": microbatches, "pipeline_schedule": schedule, "stages_per_rank": v,
            "steps": 6, "lr": 3e-3, "tensorboard": False, "save_final": False,
            "name": f"{schedule} m{microbatches}"}
    return RunConfig(**{**base, **fields})


def pinned_train(ctx: Any) -> None:
    """labkit's loop, with this rank first pinned to a core of its own (measure.pin_rank)."""
    pin_rank(ctx.rank)
    train(ctx, ctx.config)


def run_pipeline(config: RunConfig, *, pinned: bool = True, timeout: float = 60.0, runs_root: Any = None) -> Run:
    """Train `config` (strategy "pp"), each rank on its own core when `pinned`; the Run."""
    return launch(pinned_train if pinned else train, config=config, timeout=timeout, echo=False, progress=False,
                  runs_root=runs_root, name=config.name or None)


class Sweep:
    """Pipeline runs made one after another on the first `cores` cores, each rank pinned to one of them, with the
    other programs on those cores metered: what measure.gated needs (`others`, `again()`).

        sweep = Sweep([lesson_config("GPipe", microbatches=m) for m in (1, 2, 4, 8)])
        sweep.table                     # bubble_table of the runs;  sweep.runs: the Runs
    """

    def __init__(self, configs: Sequence[RunConfig], *, cores: int | None = None, runs_root: Any = None):
        cores = min(2, usable_cores()) if cores is None else cores
        self.configs, self.cores, self.runs_root = list(configs), cores, runs_root
        self._measure()

    def _measure(self) -> None:
        with pinned_to(self.cores), CpuMeter() as meter:
            start = time.time()
            self.runs = [run_pipeline(c, runs_root=self.runs_root) for c in self.configs]
            end = time.time()
        self.others = meter.cores_busy(start, end)[1]
        self.table = bubble_table(self.runs)

    def again(self) -> "Sweep":
        return Sweep(self.configs, cores=self.cores, runs_root=self.runs_root)


def bubbles(run: Run) -> pd.DataFrame:
    """One row per steady step and rank: the bubble fraction measured from that step's timestamps."""
    rows = []
    for step in sorted(run.df.step.unique()):
        if step >= STEADY_FROM:
            rows += [{"step": int(step), "rank": r, "bubble": f}
                     for r, f in bubble_fractions(step_actions(run, step)).items()]
    return pd.DataFrame(rows)


def bubble(run: Run) -> dict[int, float]:
    """{rank: median bubble fraction over the steady steps}."""
    table = bubbles(run)
    return {int(r): float(g.bubble.median()) for r, g in table.groupby("rank")}


def summary(run: Run) -> dict[str, float]:
    """The medians over the steady steps of pipetrace.step_summary: bubble (the slowest stage's rank's), between
    (its idle between actions: messages and the schedule's own work), mean (over ranks), imbalance (mean - bubble),
    wait_ms (one message's wait) and f_ms (one forward action)."""
    rows = pd.DataFrame([step_summary(step_actions(run, step)) for step in sorted(run.df.step.unique())
                         if step >= STEADY_FROM])
    out = rows.median().to_dict()
    out["wait_ms"], out["f_ms"] = out.pop("wait_s") * 1e3, out.pop("f_s") * 1e3
    return out


def formula(config: RunConfig) -> float:
    """The bubble the schedule's papers give, as a fraction of the step with equal stages and no message costs:
    (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) for Interleaved1F1B and LoopedBFS; NaN for the zero-bubble
    and DualPipe schedules, whose models need the F, I and W times (their_models)."""
    p, v, m = config.pipeline_dims[1], config.stages_per_rank, config.microbatches
    if config.pipeline_schedule in ("GPipe", "1F1B"):
        return gpipe_bubble(p, m)
    return interleaved_bubble(p, m, v) if config.pipeline_schedule in LOOPED_FORMULA else float("nan")


def bubble_table(runs: Sequence[Run]) -> pd.DataFrame:
    """Per run: schedule, p (ranks), v, m, the bubble measured (the slowest stage's), the part of it between
    actions, the mean over ranks, the stage imbalance, a message's wait against a forward's, and the formula."""
    out = []
    for run in runs:
        c, got = run.config, summary(run)
        out.append({"run": c.name, "schedule": c.pipeline_schedule, "p": c.pipeline_dims[1], "v": c.stages_per_rank,
                    "m": c.microbatches, "measured": got["bubble"], "between actions": got["between"],
                    "mean over ranks": got["mean"], "imbalance": got["imbalance"], "wait (ms)": got["wait_ms"],
                    "forward (ms)": got["f_ms"], "formula": formula(c)})
    return pd.DataFrame(out)


def their_models(ranks: int, microbatches: int) -> pd.DataFrame:
    """The bubbles and memory two READMEs tabulate, as their authors state them (their models, not measurements):
    the zero-bubble paper's (Qi et al., 2024; sail-sg/zero-bubble-pipeline-parallelism: a bubble *rate*, idle over
    compute, with F = I = W) and DeepSeek's DualPipe (a bubble *time*: F, B, W one chunk's forward, full backward
    and weight-gradient times, F&B a forward and a backward overlapped). The rates are turned into our terms, idle
    over the whole step, at `ranks` and `microbatches`; NaN where a table gives a time only."""
    p, m = ranks, microbatches
    zb, dp = "zero-bubble README", "DualPipe README"
    rows = [("1F1B", "(PP-1)(F+B); rate (p-1)/m", gpipe_bubble(p, m), "PP microbatches", "1x", "1x", f"{dp}, {zb}"),
            ("ZB1P", "(PP-1)(F+B-2W); rate (p-1)/3m", (p - 1) / (3 * m + p - 1), "as 1F1B", "1x", "1x", f"{dp}, {zb}"),
            ("ZBV", "rate 0", 0.0, "as 1F1B", "", "2x 1F1B's", zb),
            ("DualPipe", "(PP/2-1)(F&B+B-3W)", float("nan"), "PP+1 microbatches", "2x on PP devices: 2 copies",
             "", dp),
            ("DualPipeV", "(PP/2-1)(F&B+B-3W), PP/2 ranks", float("nan"), "PP+1 microbatches",
             "2x on PP/2 devices: 1 copy", "", dp)]
    return pd.DataFrame(rows, columns=["method", "model: bubble (their terms)", f"model: idle/step at p={p} m={m}",
                                       "model: activations", "model: parameters per device (vs 1F1B's)",
                                       "model: pipeline messages", "source"]).set_index("method")


def parameter_shares(run: Run) -> tuple[dict[int, float], float]:
    """({rank: the share of the model's parameter bytes that rank held}, the copies held in all), from the
    param_bytes each rank recorded on its first step:  shares, copies = parameter_shares(dualpipev_run)."""
    first = run.df[run.df.step == run.df.step.min()]
    model = make_task(run.config, 1).build_model()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    shares = {int(r.rank): float(r.param_bytes / whole) for r in first.itertuples()}
    return shares, sum(shares.values())


def placement(config: RunConfig) -> dict[int, int]:
    """{stage: rank}, as the schedule's papers lay stages out: one per rank; looped (stage s on rank s mod p) for
    the interleaved schedules; a V for ZBVZeroBubble and DualPipeV (rank 0 holds the first and the last stage)."""
    p, v = config.pipeline_dims[1], config.stages_per_rank
    if config.pipeline_schedule in V_SCHEDULES:
        return {s: s if s < p else 2 * p - 1 - s for s in range(p * v)}
    return {s: s % p for s in range(p * v)}


def messages_as_placed(run: Run) -> tuple[pd.DataFrame, bool]:
    """Each rank's point-to-point sends and receives per step (counted at the dispatcher) beside what the stages'
    placement implies: m activations forward and m gradients back over every stage boundary that crosses ranks.
    Returns the table and whether every count matched:  table, ok = messages_as_placed(run)."""
    c = run.config
    where, m = placement(c), c.microbatches
    sends, recvs = {r: 0 for r in range(c.world_size)}, {r: 0 for r in range(c.world_size)}
    for s in range(len(where) - 1):
        a, b = where[s], where[s + 1]
        if a != b:                                   # the activation goes a -> b, its gradient b -> a
            sends[a], recvs[b], sends[b], recvs[a] = sends[a] + m, recvs[b] + m, sends[b] + m, recvs[a] + m
    counted = messages(run)
    table = pd.DataFrame({"sends": counted.n_send, "receives": counted.n_recv,
                          "sends (placement)": pd.Series(sends), "receives (placement)": pd.Series(recvs)})
    ok = bool((table["sends"] == table["sends (placement)"]).all()
              and (table["receives"] == table["receives (placement)"]).all())
    return table, ok


def messages_wait_little(sweep: "Sweep") -> str:
    """Gated check: in every run of the sweep, a message waited under a tenth of a microbatch's forward (the
    premise of comparing a bubble with its formula: otherwise the bubble measured would be mostly messages)."""
    worst = (sweep.table["wait (ms)"] / sweep.table["forward (ms)"]).max()
    assert below(worst, 0.1, "most message wait / forward"), \
        f"a message waited up to {worst:.2f} of a forward\n{sweep.table.round(3)}"
    return f"at most {worst:.3f} of a forward"


def bubbles_follow_the_formula(sweep: "Sweep", tolerance: float = TOLERANCE) -> str:
    """Gated check: every run's bubble (the slowest stage's) within `tolerance` of the step of its formula."""
    gap = (sweep.table.measured - sweep.table.formula).abs()
    assert below(gap.max(skipna=False), tolerance, "largest |bubble - formula| (of the step)"), \
        f"bubble vs formula\n{sweep.table[['run', 'measured', 'formula']].round(3)}"
    return f"largest gap {gap.max():.3f} over m = {sweep.table.m.tolist()}"


def _row(sweep: "Sweep", schedule: str) -> pd.Series:
    return sweep.table.set_index("schedule").loc[schedule]


def ramp_follows_the_interleaved_formula(sweep: "Sweep", tolerance: float = TOLERANCE) -> str:
    """Gated check: Interleaved1F1B's bubble less its idle between actions (the part the formula counts: waiting
    for the other rank's compute) within `tolerance` of (p-1)/(v m+p-1)."""
    row = _row(sweep, "Interleaved1F1B")
    ramp = row.measured - row["between actions"]
    assert below(abs(ramp - row.formula), tolerance, "|ramp - formula| (of the step)"), \
        f"ramp {ramp:.3f} vs formula {row.formula:.3f}"
    return f"{ramp:.3f} vs {row.formula:.3f}"


def interleaving_idles_more_between_actions(sweep: "Sweep") -> str:
    """Gated check: Interleaved1F1B's idle between actions above 1F1B's, both in the same sweep."""
    mine, base = _row(sweep, "Interleaved1F1B")["between actions"], _row(sweep, "1F1B")["between actions"]
    assert above(mine / base, 1.0, "idle between actions, Interleaved1F1B / 1F1B"), \
        f"between actions: interleaved {mine:.3f}, 1F1B {base:.3f}"
    return f"{mine:.3f} vs 1F1B's {base:.3f}"


@dataclasses.dataclass(frozen=True)
class BubbleBelow1F1B:
    """Gated check: `schedule`'s measured bubble below 1F1B's in the same sweep (same m); with `less_between`,
    each bubble less its idle between actions (the wait for the other rank's compute, messages left out):
    claims.gated("ZBV below 1F1B", BubbleBelow1F1B("ZBVZeroBubble"), sweep)."""
    schedule: str
    less_between: bool = False

    def __call__(self, sweep: "Sweep") -> str:
        mine, base = _row(sweep, self.schedule), _row(sweep, "1F1B")
        mine, base = (r.measured - (r["between actions"] if self.less_between else 0.0) for r in (mine, base))
        what = f"{self.schedule} bubble{' less between actions' if self.less_between else ''} (limit: 1F1B's)"
        assert below(mine, base, what), f"bubble{' less between actions' if self.less_between else ''}: " \
                                        f"{self.schedule} {mine:.3f}, 1F1B {base:.3f}"
        return f"{mine:.3f} vs 1F1B's {base:.3f}"


def held(run: Run, step: int | None = None) -> dict[int, tuple[int, int]]:
    """{stage: (most microbatches in flight at once, most bytes autograd saved for them)}, replayed from one step's
    actions (the last step by default); exact counts, the same on every run of the config."""
    step = int(run.df.step.max()) if step is None else step
    return in_flight([a for actions in step_actions(run, step).values() for a in actions])


def messages(run: Run) -> pd.DataFrame:
    """Point-to-point messages per step on each rank at the last counted step (after shape inference): sends,
    receives, bytes sent; plus the all-reduces (tied embedding, replicas)."""
    df = run.df.dropna(subset=["n_send"]) if "n_send" in run.df else run.df.iloc[:0]
    last = df[df.step == df.step.max()]
    cols = [c for c in ("n_send", "bytes_send", "n_recv", "bytes_recv", "n_all_reduce", "bytes_all_reduce")
            if c in last]
    return last.set_index("rank")[cols].fillna(0).astype(int)


@shown
def timeline(runs: Sequence[Run], *, step: int | None = None, title: str | None = None) -> Figure:
    """Each run's ranks, one row each, with their actions at `step` (the last by default) as bars in time, from
    the step's first action: F blue, B red, I (backward for inputs) orange, W (weights) green."""
    runs = list(runs)
    fig = new_figure(figsize=(9, 1.0 + 0.9 * sum(r.config.world_size for r in runs)))
    ax = fig.add_subplot(1, 1, 1)
    y, ticks = 0, []
    for run in runs:
        at = int(run.df.step.max()) if step is None else step
        actions = step_actions(run, at)
        start = min(a[3] for acts in actions.values() for a in acts)
        fractions = bubble_fractions(actions)
        for rank in sorted(actions):
            for kind, stage, mb, t0, t1, _ in actions[rank]:
                ax.broken_barh([((t0 - start) * 1e3, (t1 - t0) * 1e3)], (y - 0.4, 0.8), color=KIND_COLORS[kind])
                if (t1 - t0) * 1e3 > 0.04 * _span(actions):
                    ax.text((t0 + t1 - 2 * start) * 5e2, y, f"{mb}", ha="center", va="center", fontsize=7,
                            color="white")
            ticks.append((y, f"{run.config.name} · rank {rank} (bubble {fractions[rank]:.0%})"))
            y += 1
        y += 0.5
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's first action")
    for kind, color in KIND_COLORS.items():
        ax.bar(0, 0, color=color, label={"F": "forward", "B": "backward", "I": "backward (inputs)",
                                         "W": "backward (weights)"}[kind])
    ax.legend(loc="lower right", fontsize=7, ncol=4)
    ax.set_title(title or "what each rank computed, as it ran (numbers: microbatch)")
    return fig


def _span(actions: dict[int, list]) -> float:
    rows = [a for acts in actions.values() for a in acts]
    return (max(a[4] for a in rows) - min(a[3] for a in rows)) * 1e3
