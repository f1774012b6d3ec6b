"""Checkpoint, crash, resume exactly, restart by itself (lesson 13): what is on disk, how far a broken resume
parts from the run it should continue, what restarts cost, and how often to save.

    from labkit.tricks import recovery
    recovery.on_disk(run)                        # every checkpoint directory: step, complete or not, files, bytes
    broken = recovery.forgetting(killed, "rng")  # a copy of its newest checkpoint without the RNG streams
    recovery.parting(reference, [resumed, broken], ["full", "no rng"])   # per step: |loss - reference's|
    recovery.resume_figure(reference, killed, [resumed, broken], ["full", "no rng"], killed_at=11)
    recovery.restarts_figure(run)                # one continuous loss curve, restarts marked, downtime per restart
    recovery.save_costs(run)                     # seconds and bytes per save, step time without and after a save
    recovery.loss_slope(run, first_step=12)      # the loss's trend per step: below 0 while the run still learns
    recovery.young_daly(save_s=0.05, mtbf_s=4 * 3600)   # the checkpoint interval that loses least (seconds)
    recovery.interval_figure(save_s=0.05, step_s=0.03, mtbf_s=3600)   # time lost against the interval
    recovery.contents(found / "rank0.pt")         # what one checkpoint file holds, as {key: "tensor uint8[5056]"}
    found = recovery.find(run); recovery.load_file(found / "state.pt")   # the newest complete checkpoint, read
                                                                         # with weights_only (training/state/)

Killing a rank from outside is tricks/killrank.py (KillRank); the `except Exception: continue` recipe is
tricks/swallow.py.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch
from matplotlib.figure import Figure

from ..records import Run
from ..training.state.checkpoint import (MANIFEST, PARTIAL, SAVES_LOG, checkpoints_dir, find, incomplete_reason,
                                         load_file, read_manifest, step_dirs, write_file)
from ..view import COLORS, new_figure, shown

PIECES = ("rng", "data")  # what forgetting() can leave out of each rank's file


def on_disk(run: Run | str | Path) -> pd.DataFrame:
    """One row per directory under the run's checkpoints/: its step, whether it is complete (and why not), its files
    with their sizes, and which one `latest` names. A save a kill interrupted shows as a .partial-* directory."""
    root = checkpoints_dir(run.path if isinstance(run, Run) else run)
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    rows = []
    for path in [*step_dirs(root), *sorted(root.glob(PARTIAL + "*"))]:
        files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
        why = incomplete_reason(path) if not path.name.startswith(PARTIAL) else "a save that never finished"
        rows.append({"directory": path.name, "complete": why is None, "latest": path.name == latest,
                     "why_not": why or "", "files": ", ".join(f"{k} ({v:,} B)" for k, v in files.items()),
                     "bytes": sum(files.values())})
    return pd.DataFrame(rows)


def contents(path: str | Path) -> dict[str, str]:
    """What a checkpoint file holds, one line per leaf:  contents(step_dir / "rank0.pt")["rng.torch"]."""
    def walk(value: Any, prefix: str) -> dict[str, str]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in walk(item, f"{prefix}.{key}" if prefix else
                                                                          str(key)).items()} or {prefix: "{}"}
        if isinstance(value, torch.Tensor):
            return {prefix: f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"}
        if isinstance(value, (list, tuple)) and len(value) > 4:
            return {prefix: f"{type(value).__name__} of {len(value)}"}
        return {prefix: repr(value)}
    return walk(load_file(Path(path)), "")


def forgetting(run: Run | str | Path, *pieces: str) -> Path:
    """A copy of the run's newest checkpoint from which each rank's `pieces` ("rng", "data") are left out, as a
    script that never saved them would have written it; returns the copy's directory (pass it to resume_from)."""
    unknown = [p for p in pieces if p not in PIECES]
    if unknown or not pieces:
        raise ValueError(f"pieces = {pieces!r}: name one or more of {', '.join(PIECES)}")
    source = find(run.path if isinstance(run, Run) else run)
    if source is None:
        raise FileNotFoundError(f"no complete checkpoint under {run}")
    copy = source.parent.parent / f"checkpoints-without-{'-'.join(pieces)}" / source.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source, copy)
    manifest = read_manifest(copy)
    for name in [n for n in manifest["files"] if n.startswith("rank") and n.endswith(".pt")]:
        state = load_file(copy / name)
        for piece in pieces:
            state.pop(piece, None)
        manifest["files"][name] = write_file(copy / name, state)
    (copy / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return copy


def parting(reference: Run, runs: Sequence[Run], labels: Sequence[str], column: str = "loss") -> pd.DataFrame:
    """Per step (rows) and run (columns): the largest |column - reference's| over ranks, on the steps both have."""
    ref = reference.df.set_index(["step", "rank"])[column]
    out = {}
    for run, label in zip(runs, labels):
        mine = run.df.set_index(["step", "rank"])[column]
        both = mine.index.intersection(ref.index)
        out[label] = (mine.loc[both] - ref.loc[both]).abs().groupby(level="step").max()
    return pd.DataFrame(out)


@shown
def resume_figure(reference: Run, killed: Run, resumed: Sequence[Run], labels: Sequence[str],
                  killed_at: int | None = None) -> Figure:
    """Loss of the uninterrupted run, the killed one and each resumed one | |loss - uninterrupted| per step."""
    fig = new_figure(figsize=(13, 4.2))
    ax_loss, ax_gap = fig.subplots(1, 2)
    steps = reference.steps()
    ax_loss.plot(steps["step"], steps["loss"], color="black", linewidth=3, alpha=0.35, label="uninterrupted")
    cut = killed.steps()
    ax_loss.plot(cut["step"], cut["loss"], color="gray", marker="x", markersize=4, linewidth=1, label="killed run")
    gaps = parting(reference, resumed, labels)
    floor = 1e-9  # bit-for-bit equal steps sit on the bottom edge of the log axis
    for i, (run, label, color) in enumerate(zip(resumed, labels, COLORS)):
        mine = run.steps()
        ax_loss.plot(mine["step"], mine["loss"], color=color, linewidth=1.5, linestyle="--" if i == 0 else "-",
                     label=f"resumed: {label}", zorder=3 if i == 0 else 2)
        gap = gaps[label].dropna()
        ax_gap.plot(gap.index, gap.clip(lower=floor), "o-", color=color, markersize=3, label=label)
    for ax in (ax_loss, ax_gap):
        if killed_at is not None:
            ax.axvline(killed_at, color="red", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_loss.set(title="loss (mean over ranks); red: where the rank was killed", ylabel="loss")
    ax_gap.set(yscale="log", ylim=(floor / 3, None), ylabel="max over ranks |loss - uninterrupted|",
               title=f"how far each resume parts (bottom edge: exactly equal, plotted at {floor:g})")
    ax_loss.legend(fontsize=8)
    ax_gap.legend(fontsize=8)
    return fig


@shown
def restarts_figure(run: Run, title: str | None = None) -> Figure:
    """The run's loss as one curve (each step from the attempt that stood by it), every attempt's own records
    faint beneath, each restart marked where it resumed | the downtime of each restart."""
    fig = new_figure(figsize=(13, 4.2))
    ax_loss, ax_cost = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    every = run.read_records(superseded=True)
    every = every.assign(attempt=every["attempt"].fillna(0) if "attempt" in every else 0)
    for attempt, rows in every.groupby("attempt"):
        mean = rows.groupby("step")["loss"].mean()
        color = COLORS[int(attempt) % len(COLORS)]
        ax_loss.plot(mean.index, mean.values, color=color, linewidth=6, alpha=0.35)
        if attempt < every["attempt"].max():  # where this attempt's last record is: it died in the next step
            ax_loss.plot(mean.index[-1], mean.values[-1], "x", color="red", markersize=9, markeredgewidth=2)
    steps = run.steps()
    ax_loss.plot(steps["step"], steps["loss"], color="black", linewidth=1, label="the run (one curve)")
    attempts = run.attempts()
    for attempt, row in attempts.iloc[1:].iterrows():
        ax_loss.axvline(row["first_step"], color="red", linestyle=":", linewidth=1)
        ax_loss.annotate(f"restart {attempt}", (row["first_step"], 1.0), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=8, color="red")
    ax_loss.set(xlabel="step", ylabel="loss",
                title="loss through the crashes (faint: each attempt's records; x: its last before the crash)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    restarted = attempts.iloc[1:]
    ax_cost.bar([f"restart {a}" for a in restarted.index], restarted["downtime_s"], color="tab:red")
    ax_cost.set(ylabel="seconds", title="downtime: last record before the crash\nto the first record after it")
    ax_cost.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    return fig


def save_costs(run: Run) -> dict[str, float]:
    """Per save (saves.jsonl, rank 0's clock from the first barrier to the pruning): median seconds and bytes;
    median step time of the steps that did not follow a save, and of those that did (their t_step includes it);
    paid_by_next_step: how much longer the step after a save is, in saves (about 1: the loop pays for it there)."""
    root = checkpoints_dir(run.path)
    saves = pd.read_json(root / SAVES_LOG, lines=True)
    every = run.config.checkpoint_every
    slowest = run.slowest("t_step", after=2)["t_step"]
    after_save = (slowest.index % every) == 0
    costs = {"saves": int(len(saves)), "save_s": float(saves["seconds"].median()),
             "bytes": float(saves["bytes"].median()), "step_s": float(slowest[~after_save].median()),
             "step_after_save_s": float(slowest[after_save].median())}
    costs["paid_by_next_step"] = (costs["step_after_save_s"] - costs["step_s"]) / costs["save_s"]
    return costs


def cost_table(timed: dict[str, Any]) -> pd.DataFrame:
    """One row per model size of an interleaved measurement: its parameters, then save_costs of its run, then
    bytes per parameter and a save's time in steps (save / step)."""
    from ..training.tasks import make_task
    rows = {}
    for size, t in timed.items():
        params = sum(p.numel() for p in make_task(t.run.config).build_model().parameters())
        rows[size] = {"parameters": params, **save_costs(t.run)}
    costs = pd.DataFrame(rows).T
    costs["bytes / parameter"] = costs["bytes"] / costs["parameters"]
    costs["save / step"] = costs["save_s"] / costs["step_s"]
    return costs


def fresh_import_s() -> float:
    """Seconds a fresh Python interpreter takes to import torch and torch._dynamo (what DDP pulls in): the floor of
    a restart that starts new processes, as torchrun's agent does."""
    import subprocess
    import sys
    code = "import time; t = time.perf_counter(); import torch, torch._dynamo; print(time.perf_counter() - t)"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(fresh.stdout)


def exact_resume(reference: Run, resumed: Run, columns: Sequence[str], first: int) -> tuple[dict[str, int], bool]:
    """Records of `resumed` against `reference` on the same (step, rank): per column, how many differ, and whether
    `resumed` holds exactly the reference's records from step `first` on (no step missing, none extra)."""
    ref = reference.df.set_index(["step", "rank"])
    mine = resumed.df.set_index(["step", "rank"])
    same_rows = sorted(mine.index) == [i for i in sorted(ref.index) if i[0] >= first]
    differ = {c: int((ref.loc[mine.index, c] != mine[c]).sum()) for c in columns if c in mine}
    return differ, same_rows


def loss_slope(run: Run, first_step: int = 0) -> float:
    """Least-squares slope of the run's loss (mean over ranks) per step, over its steps from `first_step` on;
    below 0 while the run still learns:  loss_slope(resumed, first_step=12) -> -0.004."""
    import numpy as np
    steps = run.steps()
    steps = steps[steps["step"] >= first_step]
    if len(steps) < 2:
        raise ValueError(f"run {run.name!r} has {len(steps)} step(s) from step {first_step} on; a slope needs 2")
    return float(np.polyfit(steps["step"].astype(float), steps["loss"].astype(float), 1)[0])


def young_daly(save_s: float, mtbf_s: float) -> dict[str, float]:
    """Seconds of work between checkpoints that lose least to saving plus redoing, for a save that takes C seconds
    and a mean time between failures M:  young_daly(save_s=0.05, mtbf_s=14400) -> {"young": ..., "daly": ...}.

    young: sqrt(2 C M) (J. W. Young, "A first order approximation to the optimum checkpoint interval",
    Communications of the ACM 17(9), 1974); daly: sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C for
    C < 2M, else M (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3), 2006)."""
    if not (save_s > 0 and mtbf_s > 0):
        raise ValueError(f"save_s = {save_s!r}, mtbf_s = {mtbf_s!r}: both must be > 0 seconds")
    ratio = save_s / (2 * mtbf_s)
    young = math.sqrt(2 * save_s * mtbf_s)
    daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s if save_s < 2 * mtbf_s else mtbf_s
    return {"young": young, "daly": daly}


def expected_overhead(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Seconds lost per second of useful work, to first order: saving (C / tau), half an interval redone per
    failure (tau / 2M), and the restart itself (R / M):  expected_overhead(60, 0.05, 14400, restart_s=5)."""
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


@shown
def interval_figure(save_s: float, step_s: float, mtbf_s: float, restart_s: float = 0.0) -> Figure:
    """The fraction of time lost (expected_overhead) against the checkpoint interval in steps, for a save of
    save_s seconds, steps of step_s, failures every mtbf_s on average; Young's and Daly's intervals marked."""
    import numpy as np
    fig = new_figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    steps = np.unique(np.logspace(0, math.log10(max(10.0, 20 * mtbf_s / step_s)), 400).astype(int))
    lost = [expected_overhead(n * step_s, save_s, mtbf_s, restart_s) for n in steps]
    ax.plot(steps, lost, color="black")
    for (name, seconds), color in zip(young_daly(save_s, mtbf_s).items(), COLORS):
        n = seconds / step_s
        ax.axvline(n, color=color, linestyle=":", label=f"{name}: every {n:,.0f} steps "
                   f"({expected_overhead(seconds, save_s, mtbf_s, restart_s):.2%} lost)")
    ax.set(xscale="log", yscale="log", xlabel="steps between checkpoints",
           ylabel="seconds lost per second of training",
           title=f"save {save_s * 1e3:.0f} ms, step {step_s * 1e3:.0f} ms, a failure every {mtbf_s / 3600:g} h")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig
