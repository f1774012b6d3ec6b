"""See every rank: its TensorBoard events read back into one table, per-rank views, and who the straggler is.

    from labkit.tricks import monitor
    table = monitor.read_tensorboard(run)   # one row per (rank, step), one column per scalar, from runs/<id>/tb/
    monitor.per_rank(table)                 # medians per rank: step time, data wait, wait in the all-reduce, ...
    monitor.rank_panels(table)              # step time | data wait | loss | grad norm | memory: a line per rank
    monitor.stragglers(run)                 # [] or [Straggler(rank=1, extra_s=0.021, ...)]
    monitor.tensorboard_command([run])      # the shell command that serves these runs on 127.0.0.1
    monitor.clock_offsets(table)            # each rank's clock minus rank 0's, from steps they ended together
    monitor.clock_is_off(table, 1, 2.5)     # holds: rank 1's clock measured 2.5 s (to a tenth) ahead of rank 0's
    monitor.same_losses(healthy, slowed)    # True: every rank's loss at every step equal in both runs (loss_gap)
    run, cmd = monitor.launch_as_nodes(cfg) # torchrun as two "nodes" writing one new run dir under runs_root()

Why compute and wait: a synchronous step ends for every rank when its all-reduce ends, and that is when the last
rank arrives. So every rank's step time grows with a straggler; what tells them apart is where the time went.
labkit's loop times forward+backward with DDP's gradient all-reduce inside it (t_fwd_bwd), so per step:
    wait_r    = t_fwd_bwd_r - min over ranks of t_fwd_bwd   (the rank that arrived last did not wait)
    compute_r = t_step_r - wait_r                           (everything the rank did on its own)
The straggler's compute grows; the others' wait grows by as much. A slowdown *inside* backward hides from this
split (everyone's t_fwd_bwd then ends together): timing the collective itself (the profiler, NCCL's flight
recorder) is the tool for that.
"""
from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd
from matplotlib.figure import Figure

from ..config import RunConfig
from ..measure.bounds import Bound, above, below
from ..records import Run
from ..rundir import RunDir, runs_root
from ..view import COLORS, in_notebook, new_figure, shown

PANELS = (("t_step", "step time (ms)", 1000.0), ("t_data", "data wait (ms)", 1000.0), ("loss", "loss", 1.0),
          ("grad_norm", "grad norm", 1.0), ("rss_mb", "resident memory (MB)", 1.0))


def read_tensorboard(run: Run | str | Path) -> pd.DataFrame:
    """Every scalar of every rank's event files (runs/<id>/tb/rank<r>/), read with TensorBoard's own reader:
    one row per (rank, step), one column per tag, plus wall_time (seconds, from the events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = RunDir(_run_path(run)).tensorboard()
    rows = []
    for folder in sorted(tb.glob("rank*"), key=lambda p: int(p.name[4:])):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event, not a sample
        events.Reload()
        for tag in events.Tags()["scalars"]:
            rows += [(int(folder.name[4:]), tag, e.step, e.value, e.wall_time) for e in events.Scalars(tag)]
    if not rows:
        raise FileNotFoundError(f"no TensorBoard events under {tb}: was the run launched with "
                                "RunConfig(tensorboard=True) (the default), and has it ended?")
    long = pd.DataFrame(rows, columns=["rank", "tag", "step", "value", "wall_time"])
    table = long.pivot_table(index=["rank", "step"], columns="tag", values="value", aggfunc="last")
    table["wall_time"] = long.groupby(["rank", "step"])["wall_time"].max()
    return table.reset_index().rename_axis(columns=None)


def compute_and_wait(table: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): t_step, wait (time in the all-reduce beyond the last arrival's) and compute (the rest)."""
    missing = [c for c in ("rank", "step", "t_step", "t_fwd_bwd") if c not in table]
    if missing:
        raise KeyError(f"compute_and_wait needs {missing}; labkit's training loop records them (this table has "
                       f"{sorted(table.columns)})")
    out = table[["rank", "step", "t_step", "t_fwd_bwd"]].copy()
    out["wait"] = out["t_fwd_bwd"] - out.groupby("step")["t_fwd_bwd"].transform("min")
    out["compute"] = out["t_step"] - out["wait"]
    return out


def per_rank(table: pd.DataFrame, after: int = 2) -> pd.DataFrame:
    """One row per rank, from step `after` on: median step time, data wait, all-reduce wait and compute (seconds),
    last loss, median grad norm, peak resident memory."""
    table = table[table["step"] >= after]
    split = compute_and_wait(table).groupby("rank")
    out = pd.DataFrame({"t_step": split["t_step"].median(), "t_data": table.groupby("rank")["t_data"].median(),
                        "wait": split["wait"].median(), "compute": split["compute"].median()})
    by_rank = table.sort_values("step").groupby("rank")
    for column, how in (("loss", "last"), ("grad_norm", "median"), ("rss_mb", "max")):
        if column in table:
            out[column] = getattr(by_rank[column], how)()
    return out


@dataclass(frozen=True)
class Straggler:
    """A rank the others waited for: step after step its compute exceeds theirs (by extra_s at the median step),
    and they waited others_wait_s."""

    rank: int
    extra_s: float          # per step, its compute minus the other ranks' median compute: the median over steps
    share: float            # extra_s as a fraction of the others' compute
    others_wait_s: float    # the other ranks' median wait in the all-reduce, per step
    own_wait_s: float       # its own median wait (near zero: it arrives last)
    slow_steps: float       # the share of steps in which its compute exceeded theirs by more than min_share


STEADY = 0.75   # stragglers' default `steady`: the share of steps in which a straggler's compute stands out


def stragglers(source: Run | pd.DataFrame, *, after: int = 2, min_share: float = 0.2,
               steady: float = STEADY, shares: dict[int, float] | None = None) -> list[Straggler]:
    """The ranks the others waited for, slowest first; [] when no rank stands out:  monitor.stragglers(run).

    A rank is named when its compute exceeds the other ranks' median compute by more than min_share of theirs in
    at least `steady` of the steps (from step `after` on), AND the others spent at least half its median excess
    waiting in the all-reduce while it waited less than them. A straggler is slow step after step: a stretch of
    slow steps (another program on the rank's core, the scheduler's turns when ranks outnumber cores) is not
    one, and a slow rank that nobody waits for (no such thing in synchronous DDP) is not named either.

    shares: a dict to fill with every rank's share of slow steps (the number held against `steady`), named or
    not, so that a check can record how near the threshold each rank came (share_bounds)."""
    table = source.df if isinstance(source, Run) else source
    split = compute_and_wait(table[table["step"] >= after])
    compute = split.pivot(index="step", columns="rank", values="compute").dropna()   # steps every rank recorded
    waits = split.groupby("rank")["wait"].median()
    found = []
    for rank in compute.columns:
        if compute.shape[1] < 2 or compute.empty:
            continue
        base = compute.drop(columns=rank).median(axis=1)      # the others' compute, step by step
        excess = compute[rank] - base
        slow_steps = float((excess > min_share * base).mean())
        if shares is not None:
            shares[int(rank)] = slow_steps
        extra, waited = float(excess.median()), float(waits.drop(rank).median())
        if slow_steps >= steady and waited > extra / 2 and waits[rank] < waited:
            found.append(Straggler(int(rank), extra, extra / float(base.median()), waited, float(waits[rank]),
                                   slow_steps))
    return sorted(found, key=lambda s: -s.extra_s)


def clock_offsets(table: pd.DataFrame, after: int = 2) -> pd.Series:
    """Each rank's clock minus rank 0's, estimated from when they recorded the same steps (seconds).

    Every rank leaves a step's all-reduce at the same moment, so on one clock the ranks record a step within a
    fraction of a step time of each other; a steady difference is the nodes' clocks disagreeing. Plot against
    the step, which every rank counts alike, not against wall time."""
    times = table[table["step"] >= after].pivot_table(index="step", columns="rank", values="wall_time")
    return times.sub(times[times.columns[0]], axis=0).median().rename("clock_offset_s")


CLOCK_SHARE = 0.1   # clock_is_off's tolerance, as a share of the offset it is asked about (or of `scale`)


def clock_is_off(table: pd.DataFrame, rank: int, seconds: float, *, scale: float | None = None,
                 after: int = 2) -> Bound:
    """Whether the events say `rank`'s clock is `seconds` ahead of rank 0's, to CLOCK_SHARE of `scale` (default:
    of `seconds`):  clock_is_off(table, 1, 2.5) holds when clock_offsets(table)[1] is within 0.25 s of 2.5;
    clock_is_off(table, 1, 0.0, scale=2.5): one clock, to the same 0.25 s. A measure.below Bound, true when it
    holds: a claim given it keeps the offset's error and its margin."""
    tolerance = CLOCK_SHARE * abs(scale if scale is not None else seconds)
    return below(abs(clock_offsets(table, after)[rank] - seconds), tolerance,
                 f"|rank {rank}'s clock offset - {seconds:g} s| (s)")


SAME_LOSS = 1e-6   # same_losses' tolerance: float32 losses of the same computation agree to far better


def loss_gap(a: Run | pd.DataFrame, b: Run | pd.DataFrame) -> float:
    """The largest difference between two runs' losses at the same (rank, step); inf when they did not record the
    same (rank, step)s (a run that stopped early is not "the same") or when one holds a NaN where the other holds a
    number (a NaN against a NaN counts 0):  loss_gap(healthy, slowed) -> 0.0."""
    losses = [(s.df if isinstance(s, Run) else s).set_index(["rank", "step"])["loss"].astype(float).sort_index()
              for s in (a, b)]
    if not losses[0].index.equals(losses[1].index):
        return float("inf")
    both_nan = losses[0].isna() & losses[1].isna()
    gaps = (losses[0] - losses[1]).abs().where(~both_nan, 0.0).fillna(float("inf"))
    return float(gaps.max()) if len(gaps) else 0.0


def same_losses(a: Run | pd.DataFrame, b: Run | pd.DataFrame, tolerance: float = SAME_LOSS) -> bool:
    """Whether every rank's loss at every step is the same in both runs, to `tolerance` (a delay changes when a
    rank computes, not what): same_losses(healthy, slowed) -> True."""
    return loss_gap(a, b) < tolerance


def launch_as_nodes(config: RunConfig, run_dir: str | Path | None = None, *, nodes: int = 2,
                    timeout: float = 180.0) -> tuple[Run, str]:
    """Run `config` under torchrun as `nodes` nodes of one process each, all on this machine and writing to one
    run_dir (what a shared filesystem gives a real cluster): by default a new one under runs_root(), so that each
    call is a run of its own. Returns the Run and node 0's command line."""
    import subprocess
    import sys
    import tempfile
    if run_dir is None:
        run_dir = RunDir.new(runs_root(), f"{config.name or config.task}-{nodes}-nodes").path
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = config.replace(world_size=nodes)
    config.save(run_dir / "job.json")
    port, scratch = free_port(), tempfile.mkdtemp(prefix="torchrun-", dir=run_dir)
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(n),
                 "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "-m", "labkit", "run", str(run_dir / "job.json"), "--run-dir", str(run_dir)] for n in range(nodes)]
    env = {**os.environ, "TMPDIR": scratch, "OMP_NUM_THREADS": "1"}  # torchelastic's files stay with the run
    # Each agent leads its own process group, so that a stuck job is stopped with its ranks, not just its agent.
    agents = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for c in commands]
    try:
        outputs = [a.communicate(timeout=timeout)[0] for a in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    failed = [(n, a.returncode, out[-2000:]) for n, (a, out) in enumerate(zip(agents, outputs)) if a.returncode]
    if failed:
        raise RuntimeError(f"torchrun node(s) failed: {failed}")
    return Run(run_dir), " ".join(["torchrun"] + commands[0][3:])


@shown
def rank_panels(table: pd.DataFrame, title: str = "") -> Figure:
    """Step time | data wait | loss | grad norm | memory against the step, one line per rank."""
    panels = [p for p in PANELS if p[0] in table]
    fig = new_figure(figsize=(3.2 * len(panels), 3.2))
    for ax, (column, label, scale) in zip(fig.subplots(1, len(panels), sharex=True), panels):
        for rank, rows in table.groupby("rank"):
            ax.plot(rows["step"], rows[column] * scale, color=COLORS[int(rank) % len(COLORS)], label=f"rank {rank}")
        ax.set(title=label, xlabel="step")
    fig.axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


@shown
def time_vs_step(table: pd.DataFrame, column: str = "loss", title: str = "") -> Figure:
    """`column` per rank against wall time (seconds after the earliest event) and against the step, side by side:
    with clocks that disagree the left panel pulls the ranks apart, the right one does not."""
    fig = new_figure(figsize=(10, 3.4))
    by_time, by_step = fig.subplots(1, 2, sharey=True)
    start = table["wall_time"].min()
    for rank, rows in table.groupby("rank"):
        color = COLORS[int(rank) % len(COLORS)]
        by_time.plot(rows["wall_time"] - start, rows[column], ".-", color=color, label=f"rank {rank}")
        by_step.plot(rows["step"], rows[column], ".-", color=color, label=f"rank {rank}")
    by_time.set(xlabel="wall time of the record (s)", ylabel=column, title="x = each node's clock")
    by_step.set(xlabel="step", title="x = step")
    by_time.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


@shown
def compute_wait_bars(runs: dict[str, Run | pd.DataFrame], after: int = 2) -> Figure:
    """Per run (a panel each), per rank: median compute and all-reduce wait per step, stacked (= step time)."""
    fig = new_figure(figsize=(4.2 * len(runs), 3.4))
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for ax, (label, source) in zip(axes, runs.items()):
        table = source.df if isinstance(source, Run) else source
        medians = compute_and_wait(table[table["step"] >= after]).groupby("rank")[["compute", "wait"]].median()
        ranks = [f"rank {r}" for r in medians.index]
        ax.bar(ranks, medians["compute"] * 1000, color=COLORS[0], label="compute (its own work)")
        ax.bar(ranks, medians["wait"] * 1000, bottom=medians["compute"] * 1000, color=COLORS[3],
               label="wait in the all-reduce")
        ax.set(title=label, ylabel="ms per step (median)")
    axes[0].legend(fontsize=8)
    return fig


def tensorboard_command(runs: Sequence[Run], port: int | None = None) -> tuple[str, int]:
    """(the command that serves these runs' events on 127.0.0.1, the free port it names)."""
    port = port or free_port()
    spec = ",".join(f"{_tb_name(r)}:{RunDir(r.path).tensorboard()}" for r in runs)
    return f"tensorboard --logdir_spec {spec} --host 127.0.0.1 --port {port}", port


def someone_is_watching() -> bool:
    """True in a notebook that a person's frontend runs (JupyterLab, VS Code); False in scripts and headless
    runners (nbmake, nbconvert), where an embedded TensorBoard would only leave a server behind. Frontends a
    person uses allow input() on each cell; nbclient, under nbmake and nbconvert, runs cells with input refused."""
    if not in_notebook():
        return False
    from IPython import get_ipython
    return bool(getattr(get_ipython().kernel, "_allow_stdin", False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tb_name(run: Run) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in run.name)


def _run_path(run: Run | str | Path) -> Path:
    return run.path if isinstance(run, Run) else Path(run)


# The lesson's straggler claims, one per function: each reads the two timed runs' events back (labels as in
# lesson 11's interleaved(...)), asserts one thing, and returns what it measured. Hand them to claims.gated.
_READ: dict[tuple, pd.DataFrame] = {}   # per-rank medians already read, by (run dir, labels): five claims, one read


def _medians(timed, labels=("healthy", "rank 1 slowed")) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    runs = [timed[label].run for label in labels]
    key = tuple(str(getattr(run, "path", id(run))) for run in runs)
    if key not in _READ:
        _READ.clear()
        _READ[key] = [per_rank(read_tensorboard(run)) for run in runs]
    calm, slowed = _READ[key]
    return calm, slowed, (slowed - calm) * 1000


def everyone_slowed(timed, delay_s: float) -> str:
    """Every rank's median step grew by more than half the delay one rank was given."""
    grew = _medians(timed)[2]["t_step"]
    assert above(grew.min(skipna=False), 0.5 * delay_s * 1000, "least step growth (ms)"), grew
    return f"step time grew {grew.round(1).tolist()} ms per rank"


def steps_end_together(timed) -> str:
    """In the slowed run, the ranks' median step times are within 20 % of each other: the spread, slowest over
    fastest less 1, under 0.2 (the ratio itself cannot go below 1, so its room is read off the spread)."""
    steps = _medians(timed)[1]["t_step"]
    assert below(steps.max() / steps.min() - 1, 0.2, "slowest / fastest rank's median step, less 1"), steps
    return f"slowest / fastest rank's median step {steps.max() / steps.min():.2f}"


def only_its_compute_grew(timed, rank: int, delay_s: float) -> str:
    """The slowed rank's compute grew by more than half the delay; no other rank's compute did."""
    grew = _medians(timed)[2]["compute"]
    others, limit = grew.drop(rank), 0.5 * delay_s * 1000
    own = above(grew.loc[rank], limit, "slowed rank's compute growth (ms)")
    rest = below(others.max(), limit, "other ranks' largest compute growth (ms)")
    assert own and rest, grew
    return f"compute grew {grew.round(1).tolist()} ms per rank"


def no_false_alarm(timed, label: str = "healthy") -> str:
    """monitor.stragglers names no rank in the healthy run."""
    shares: dict[int, float] = {}
    named = stragglers(read_tensorboard(timed[label].run), shares=shares)
    share_bounds(shares, None)
    assert named == [], named
    return "none named"


def straggler_named(timed, rank: int, label: str = "rank 1 slowed") -> str:
    """monitor.stragglers names exactly the slowed rank."""
    shares: dict[int, float] = {}
    named = [s.rank for s in stragglers(read_tensorboard(timed[label].run), shares=shares)]
    share_bounds(shares, rank)
    assert named == [rank], named
    return f"named {named}"


def share_bounds(shares: dict[int, float], rank: int | None, label: str = "") -> list[Bound]:
    """The numbers stragglers held against STEADY (its `shares`), kept as bounds for a gated check's log: the share
    of slow steps of `rank`, the one that should be named, above STEADY, and the largest share of the others below
    it (rank None: no rank should be named). Recorded, not asserted: the claim is the names stragglers decided on
    (its wait rules count too, and it names a share equal to STEADY, where above() is strict); these say how near
    its threshold each rank came:  share_bounds({0: 0.1, 1: 0.9}, 1) -> [0.9 above 0.75, 0.1 below 0.75]."""
    prefix = f"{label}: " if label else ""
    kept = []
    if rank is not None and rank in shares:
        kept.append(above(shares[rank], STEADY, f"{prefix}rank {rank}'s share of slow steps (to be named)"))
    others = [share for r, share in shares.items() if r != rank]
    if others:
        kept.append(below(max(others), STEADY, f"{prefix}largest share of slow steps, ranks not to be named"))
    return kept
