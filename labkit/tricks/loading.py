"""Where a step's time goes when data loading is the question (lesson 05): the split of a step, its table and
picture, the cost of restarting workers, and the simplest model of workers sharing cores.

    timed = measure.interleaved({"0 workers": cfg, "2 workers": cfg.replace(data_workers=2)}, rounds=2, cores=2,
                                warmup=4)
    table = split_table(timed)            # per setting: t_data_ms, t_fwd_bwd_ms, ..., cores busy, others' cores
    fig = plot_step_split(table)          # stacked bars, one per setting
    step_split(timed["2 workers"].run)    # {"t_data": 0.031, "t_fwd_bwd": 0.004, "t_optim": 0.001, "t_step": 0.037}
    predicted_step(workers=2, cores=2, data_ms=32, compute_ms=3)   # {"ms per step": 17.5, ...}

The lesson's claims, each in one line: what a DistributedSampler and a DataLoader did inside a function the
learner launched (shards_cover_once, epoch_orders, made_by_workers, worker_pids: a rank returns the list of
(epoch, sample index, pid of the process that made it) it saw), and the checks handed to the speed gate, made
for a column and a bound (busy_below, busy_gain_below, busy_above, ratio_below, ratio_above, saves_under,
restarts_cost, persistent_pays_once):

    claims.gated("2 workers cut t_data below 0.75x", ratio_below("t_data_ms", 0.75), timed.only([0, 2]))

The digits pipeline the lesson takes apart is the training loop's own (labkit/training/data.py), reachable here:
DigitsStream(cfg, world_size=1, rank=0).make_loader() is its DataLoader, digits_data() the images and labels,
sample_work(image, seed=, position=, cost_ms=) the per-sample work a worker does (RunConfig.sample_cost_ms).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import pandas as pd

from ..measure.bounds import above, below
from ..measure.claims import LIMIT_CORES
from ..measure.timing import Timing
from ..training.data import DigitsSamples, DigitsStream, digits_data, sample_work  # noqa: F401 - the lesson's door
from ..view import COLORS, new_figure, shown

PARTS = ("t_data", "t_fwd_bwd", "t_optim")


def step_split(run: Any, warmup: int = 4) -> dict[str, float]:
    """Mean seconds per step of t_data, t_fwd_bwd, t_optim and t_step (averaged over ranks, so the parts add up),
    skipping `warmup` steps and the last one (it also stops the workers):  step_split(run) -> {"t_data": 0.031, ...}.

    The mean, not the median: workers side by side finish batches in bunches, so the waits are uneven (long ones,
    then short ones while ready batches are taken). The median of such a series can be a short wait; the mean is
    the total wait per step, which is what decides the throughput."""
    df = run.df
    df = df[(df.step >= warmup) & (df.step < df.step.max())] if df.step.max() > warmup else df
    per_step = df.groupby("step")[[*PARTS, "t_step"]].mean()
    return {name: float(per_step[name].mean()) for name in per_step}


def split_table(timed: Mapping[str, Timing], warmup: int | None = None) -> pd.DataFrame:
    """One row per setting of a measure.Timings: the step's parts in ms (step_split of the kept run), samples/s,
    the cores our processes and other programs kept busy, and t_cpu_ms, the CPU our processes spent per step:

        split_table(measure.interleaved({...}, rounds=2, cores=2, warmup=4))

    `warmup` defaults to the one the Timings was measured with."""
    warmup = warmup if warmup is not None else getattr(timed, "settings", {}).get("warmup", 4)
    rows = {}
    for label, t in timed.items():
        split = step_split(t.run, warmup)
        row = {f"{name}_ms": 1e3 * value for name, value in split.items()}
        row["samples/s"] = t.run.config.global_batch / split["t_step"]
        row.update({"cores busy": t.ours, "others' cores": t.others, "t_cpu_ms": row["t_step_ms"] * t.ours})
        rows[label] = row
    return pd.DataFrame(rows).T


def epoch_starts(runs: Mapping[str, Any], steps_per_epoch: int) -> pd.DataFrame:
    """Per run (rows): t_data of its first step, of later epochs' first steps (median) and of the other steps
    (median), in ms of the slowest rank, and the whole run's seconds:  epoch_starts(timed.runs, steps_per_epoch=5)."""
    rows = {}
    for label, run in runs.items():
        t_data = run.df.groupby("step")["t_data"].max() * 1e3
        steps = t_data.index
        later_epochs, others = (steps % steps_per_epoch == 0) & (steps > 0), steps % steps_per_epoch != 0
        rows[label] = {"run's first step (ms)": t_data.iloc[0],
                       "epoch's first step (ms, median)": t_data[later_epochs].median(),
                       "other steps (ms, median)": t_data[others & (steps < steps.max())].median(),
                       "whole run (s)": run.df.groupby("step")["t_step"].max().sum()}
    return pd.DataFrame(rows).T


def predicted_step(workers: int = 0, cores: int = 2, data_ms: float = 32.0, compute_ms: float = 3.0) -> dict:
    """The simplest model of a loader: a step needs `data_ms` of sample work and `compute_ms` of compute; `workers`
    processes prepare batches side by side, and everything shares `cores` cores:

        predicted_step(workers=2, cores=2, data_ms=32, compute_ms=3) -> {"ms per step": 17.5, ...}"""
    if workers == 0:
        step = data_ms + compute_ms                # one process does both, one after the other
    else:                                          # overlapped, side by side, and never below the cores' worth
        step = max(compute_ms, data_ms / workers, (data_ms + compute_ms) / cores)
    return {"workers": workers, "cores": cores, "ms per step": round(step, 1),
            "ms waiting for data": round(max(0.0, step - compute_ms), 1)}


@shown
def plot_step_split(table: pd.DataFrame, *, floor_ms: float | None = None, notes: Any = None,
                    title: str | None = None) -> Any:
    """Stacked bars, one per row of a split_table (t_data_ms, t_fwd_bwd_ms, t_optim_ms, t_step_ms); a black line
    marks the step time, a dashed one `floor_ms`; above each bar a note, by default the cores busy (and others'
    cores when above claims.LIMIT_CORES):  plot_step_split(split_table(timed), floor_ms=16, title="...")."""
    fig = new_figure(figsize=(max(8.0, 1.1 * len(table) + 4), 4.5))
    ax = fig.subplots()
    xs, bottom = range(len(table)), [0.0] * len(table)
    names = {"t_data": "waiting for data (t_data)", "t_fwd_bwd": "forward + backward (t_fwd_bwd)",
             "t_optim": "optimizer (t_optim)"}
    for part, color in zip(PARTS, [COLORS[3], COLORS[0], COLORS[2]]):
        heights = list(table[f"{part}_ms"])
        ax.bar(xs, heights, bottom=bottom, color=color, label=names[part], width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.hlines(list(table["t_step_ms"]), [x - 0.35 for x in xs], [x + 0.35 for x in xs], color="black",
              linewidth=2, zorder=3, label="step time (t_step)")
    if notes is None and "cores busy" in table:
        notes = [f"{ours:.1f} cores busy" + (f"\n(others: {others:.1f})" if others > LIMIT_CORES else "")
                 for ours, others in zip(table["cores busy"], table["others' cores"])]
    for x, top, note in zip(xs, table["t_step_ms"], notes if notes is not None else []):
        ax.annotate(note, (x, top), xytext=(0, 6), textcoords="offset points", ha="center", fontsize=8)
    if floor_ms is not None:
        ax.axhline(floor_ms, color="black", linestyle="--", linewidth=1,
                   label=f"floor: sample work / cores = {floor_ms:.0f} ms")
    ax.set_xticks(list(xs), [str(i).replace(", ", "\n") for i in table.index], fontsize=9)
    top = max([*table["t_step_ms"], floor_ms or 0.0])
    ax.set(ylabel="ms per step (mean after warm-up)", title=title or "", ylim=(0, 1.2 * top))   # room for notes
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# --- what the learner's own loader did (lesson 05's torch code: a function returning the samples it saw) -------------

Seen = Sequence[tuple[int, int, int]]   # (epoch, sample index, pid of the process that made the sample)


def shards_cover_once(seen_by_rank: Sequence[Seen], size: int) -> tuple[str, bool]:
    """Whether, in every epoch, the ranks' samples are each index of 0..size-1 exactly once (the sampler's shards
    do not overlap and leave nothing out):  shards_cover_once([run.result(r)["seen"] for r in (0, 1)], 256)."""
    epochs = sorted({e for seen in seen_by_rank for e, _, _ in seen})
    per_rank = [[sorted(i for e, i, _ in seen if e == epoch) for seen in seen_by_rank] for epoch in epochs]
    ok = bool(epochs) and all(sorted(i for rank in ranks for i in rank) == list(range(size)) for ranks in per_rank)
    sizes = "/".join(str(len(rank)) for rank in per_rank[0]) if per_rank else "nothing"
    return f"{len(epochs)} epochs, {sizes} samples per rank of {size}", ok


def epoch_orders(seen: Seen) -> list[list[int]]:
    """One rank's sample indices per epoch, in the order it got them:  epoch_orders(run.result(0)["seen"])."""
    epochs = sorted({e for e, _, _ in seen})
    return [[i for e, i, _ in seen if e == epoch] for epoch in epochs]


def worker_pids(seen: Seen) -> list[set[int]]:
    """Per epoch, the processes that made one rank's samples:  worker_pids(run.result(0)["seen"]) -> [{812, 813}, ...]."""
    epochs = sorted({e for e, _, _ in seen})
    return [{p for e, _, p in seen if e == epoch} for epoch in epochs]


def made_by_workers(result: Mapping[str, Any], workers: int) -> tuple[str, bool]:
    """Whether `workers` processes other than the rank made every sample of every epoch, from what a rank returned
    ({"rank pid": ..., "seen": [...]}):  made_by_workers(run.result(0), workers=2)."""
    pids = worker_pids(result["seen"])
    ok = bool(pids) and all(len(p) == workers and result["rank pid"] not in p for p in pids)
    return f"{[len(p) for p in pids]} processes per epoch, rank's own pid {'not ' * ok}among them", ok


# --- checks for the speed gate: each asserts on split_table(timed) and returns what it measured ------------------

def busy_below(limit: float) -> Callable[[Any], str]:
    """A gated check: every setting kept fewer than `limit` cores busy."""
    def check(timed: Any) -> str:
        busy = split_table(timed)["cores busy"]
        assert below(busy.max(skipna=False), limit, "most cores busy"), \
            f"cores busy {busy.round(2).tolist()}, not all under {limit:g}"
        return f"{busy.max():.2f} cores busy"
    return check


def busy_gain_below(limit: float) -> Callable[[Any], str]:
    """A gated check: every setting after the first kept fewer than `limit` more cores busy than the first. One
    DataLoader worker is one process with one thread (the loader sets it so): it can add at most one core."""
    def check(timed: Any) -> str:
        busy = split_table(timed)["cores busy"]
        gain = busy.iloc[1:] - busy.iloc[0]
        assert below(gain.max(skipna=False), limit, "most cores busy gained over the first setting"), \
            f"cores busy {busy.round(2).tolist()}: {gain.round(2).tolist()} more, not all under {limit:g}"
        return f"+{gain.max():.2f} cores busy ({busy.iloc[0]:.2f} -> {busy.iloc[1:].max():.2f})"
    return check


def busy_above(limit: float) -> Callable[[Any], str]:
    """A gated check: every setting kept more than `limit` cores busy. Its bound is on the cores left idle (under
    cores - limit): cores busy cannot pass the cores pinned, so the room of a claim near them is read off the idle."""
    def check(timed: Any) -> str:
        busy, cores = split_table(timed)["cores busy"], timed.settings["cores"]
        assert below(cores - busy.min(skipna=False), cores - limit, "most cores left idle"), \
            f"cores busy {busy.round(2).tolist()}, not all over {limit:g}"
        return f"{busy.min():.2f} cores busy"
    return check


def ratios(column: pd.Series) -> pd.Series:
    """Every row after the first over the first:  ratios(table["t_step_ms"])."""
    return column.iloc[1:] / column.iloc[0]


def ratio_below(column: str, bound: float) -> Callable[[Any], str]:
    """A gated check: `column` of every setting after the first stays under `bound` x the first's."""
    def check(timed: Any) -> str:
        r = ratios(split_table(timed)[column])
        assert below(r.max(skipna=False), bound, f"{column} / the first setting's, most"), \
            f"{column}: {r.round(2).tolist()} x the first, not all under {bound:g}"
        return f"{column} {r.max():.2f}x"
    return check


def ratio_above(column: str, bound: float) -> Callable[[Any], str]:
    """A gated check: `column` of every setting after the first stays over `bound` x the first's."""
    def check(timed: Any) -> str:
        r = ratios(split_table(timed)[column])
        assert above(r.min(skipna=False), bound, f"{column} / the first setting's, least"), \
            f"{column}: {r.round(2).tolist()} x the first, not all over {bound:g}"
        return f"{column} {r.min():.2f}x"
    return check


def median_step_ms(timing: Timing) -> float:
    """Wall ms per steady step of one setting, the median over its rounds (not only the repeat kept):
    median_step_ms(timed["2 workers"])."""
    return 1e3 * float(pd.Series([step for _, step in timing.repeats] or [timing.step_s]).median())


def saved_share(timed: Any, gain: tuple[str, str], reference: tuple[str, str]) -> float:
    """The step time going from gain[0] to gain[1] saves, as a share of what `reference` saves (each setting's
    median over rounds):  saved_share(one_rank, ("2 workers", "3 workers"), ("1 worker", "2 workers")) -> 0.24."""
    step = {label: median_step_ms(timed[label]) for label in {*gain, *reference}}
    return (step[gain[0]] - step[gain[1]]) / (step[reference[0]] - step[reference[1]])


def extra_worker_unchecked(timed: Any, cores: int) -> str:
    """Why lesson 05 shows, and does not claim, what a worker beyond the cores buys: the reason not_checked
    records, with this run's share. Two workers on two vCPUs stepped anywhere from 18 to 24 ms over quiet runs (the
    floor: 16), so what a third one bought ranged from 0.04 to 2.96 times what the second bought over sixteen runs:
    it fills gaps two workers leave, and how many gaps there are is up to the scheduler."""
    labels = list(timed)
    share = saved_share(timed, (labels[cores], labels[cores + 1]), (labels[cores - 1], labels[cores]))
    return (f"this run: worker {cores + 1} saved {share:.2f} of what worker {cores} saved; over sixteen quiet runs "
            "on 2 vCPUs it ranged from 0.04 to 2.96 (the 2-worker step between 18 and 24 ms): no room to claim "
            "'little'")


def saves_under(share: float, gains: Sequence[tuple[str, str]], reference: tuple[str, str]) -> Callable[[Any], str]:
    """A gated check: going from `before` to `after`, for each (before, after) in `gains`, saves under `share` of
    the step time that `reference` (before, after) saves. Step times are each setting's median over rounds:

        saves_under(0.5, [("2 workers", "3 workers")], ("1 worker", "2 workers"))  # a 3rd worker buys little

    A knob that buys nothing more shows as a share near 0 (or below: a little slower), one that buys what the
    reference bought as a share near 1, so a limit of a half stands far from both; the ratio of the two step times
    alone would sit near 1 either way, within the noise of a shared machine."""
    def check(timed: Any) -> str:
        step = {label: median_step_ms(t) for label, t in timed.items()}
        bought = step[reference[0]] - step[reference[1]]
        assert bought > 0, f"the reference, {reference[0]} -> {reference[1]}, saved no step time: {step}"
        shares = {f"{b} -> {a}": (step[b] - step[a]) / bought for b, a in gains}
        worst = max(shares, key=shares.get)
        assert below(shares[worst], share, f"step time saved, {worst} / {reference[0]} -> {reference[1]}"), \
            f"{worst} saved {shares[worst]:.2f} of what {reference[0]} -> {reference[1]} saved " \
            f"({bought:.1f} ms): {step}"
        return (", ".join(f"{k} saved {v:.2f}" for k, v in shares.items())
                + f" of the {bought:.1f} ms {reference[0]} -> {reference[1]} saved")
    return check


def restarts_cost(steps_per_epoch: int, ms: float = 5.0) -> Callable[[Any], str]:
    """A gated check on (non-persistent, persistent) runs: an epoch's first step waits over `ms` longer for data
    without persistent workers than with them."""
    def check(timed: Any) -> str:
        starts = epoch_starts(timed.runs, steps_per_epoch)["epoch's first step (ms, median)"]
        cost = starts.iloc[0] - starts.iloc[1]
        assert above(cost, ms, "epoch's first step, not persistent minus persistent (ms)"), \
            f"restarting the workers cost {cost:.1f} ms at an epoch start, not over {ms:g}\n{starts}"
        return f"{cost:.0f} ms per epoch start"
    return check


def persistent_pays_once(steps_per_epoch: int, ms: float = 5.0) -> Callable[[Any], str]:
    """A gated check on (non-persistent, persistent) runs: persistent workers still start once, so the run's first
    step waits over `ms` longer than a later epoch's first step."""
    def check(timed: Any) -> str:
        row = epoch_starts(timed.runs, steps_per_epoch).iloc[1]
        first, later = row["run's first step (ms)"], row["epoch's first step (ms, median)"]
        assert above(first - later, ms, "run's first step minus later epochs' first (ms)"), \
            f"first step {first:.1f} ms, later epochs' first {later:.1f} ms (margin {ms:g})"
        return f"first step {first:.0f} ms, later epochs' {later:.0f} ms"
    return check


def pinned_batch(config: Any) -> tuple[bool, str]:
    """(whether the first batch of a pin_memory loader came out pinned, what PyTorch warned about pin_memory) in
    this process, with no sample work:  pinned_batch(cfg). Call it only where no accelerator is: with one, pinning
    initialises it in this process, and ranks forked afterwards could not use it."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = DigitsStream(config.replace(sample_cost_ms=0.0, pin_memory=True), world_size=1, rank=0)
        x, _ = stream.batch(0)
        stream.close()
    said = [str(w.message) for w in caught if "pin_memory" in str(w.message)]
    return x.is_pinned(), said[0] if said else ""


def worker_warning(run: Any, rank: int = 0) -> str:
    """PyTorch's warning about more DataLoader workers than the cores it sees, from a rank's log ("" if none):
    worker_warning(timed["3 workers"].run)."""
    said = [line for line in run.log(rank).splitlines() if "suggested max" in line]
    return said[0].split("UserWarning: ")[-1] if said else ""
