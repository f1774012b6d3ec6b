"""Seed each rank yourself (lesson 08): the same initial weights on every rank, a random stream of
each rank's own for dropout and augmentation, and the same again in every run with the same seed;
checked on 2 gloo ranks.

    def build_for_rank(seed, rank, make_model):   # seed, build with make_model(), seed again
        ...                                       # return the model
    report = check_seeding(build_for_rank)
    build_for_rank = report.use(seeded_build)     # yours if it passed

Each rank starts as a process that torchrun starts does: its torch, NumPy and Python generators
seeded from OS entropy (forked ranks would otherwise inherit the notebook's states and look seeded
when they are not). It calls `build_for_rank(seed, rank, make_model)` for two seeds, reads the
model's initial weights as bytes, then draws what training would draw next: a dropout mask through
the model's own Dropout (torch's global stream), and numbers from NumPy's and Python's generators
(augmentation). Two launches with the same seeds are compared. The reference is no code of the
learner's but the properties themselves:

    runs      every rank finished and returned a torch module (a raise names the rank and the
              learner's line)
    repeats   the same seed twice gives every rank the same weights and the same draws (nothing
              unseeded; no rank left unseeded, as with `if rank == 0: torch.manual_seed(seed)`)
    weights   every rank's initial weights are the same bytes (no rank-dependent seed before
              make_model())
    noise     the ranks' dropout masks, NumPy and Python draws differ (not one seed everywhere)
    seed      another seed gives other weights and other masks (the seed argument is used)
"""
from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..training.seeding import seed_everything
from .learner import learner_part, run_checked
from .report import Report

SEEDS = (1234, 99)       # the seed judged, and another that must change everything
MASK = 4096              # positions of the dropout mask drawn after building
DRAWS = 64               # NumPy and Python numbers drawn after building
WORLD = 2
STREAMS = {"torch": "dropout masks (torch's stream)", "numpy": "NumPy draws (augmentation)",
           "python": "Python random draws (augmentation)"}
SEEDERS = {"torch": "the seed after make_model() is not drawn from `seed`",
           "numpy": "seed NumPy too (np.random.seed), or seeds.seed_everything: it seeds all three",
           "python": "seed Python too (random.seed), or seeds.seed_everything: it seeds all three"}


def make_model() -> nn.Module:
    """The model the checker hands the learner's function: weights drawn from torch's stream."""
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 1))


def seeded_build(seed: int, rank: int, make_model: Callable[[], nn.Module]) -> nn.Module:
    """The reference: seed every rank alike, build, then give each rank a stream of its own (torch,
    NumPy and Python, all three: dropout and augmentation may draw from any of them)."""
    seed_everything(seed)                 # the same on every rank: the same initial weights
    model = make_model()
    seed_everything(seed, rank=rank)      # a seed of this rank's own, the same every run
    return model


def _fresh_process() -> None:
    """Seed all three generators from OS entropy, as a process that torchrun starts is."""
    torch.seed()
    np.random.seed(None)
    random.seed()


def _draws(model: Any) -> dict[str, Any]:
    """What a rank holds after the learner's function: the weights' bytes, then the next dropout
    mask and the next NumPy and Python draws."""
    if not isinstance(model, nn.Module):
        return {"returned": type(model).__name__}
    weights = [t.detach().cpu().contiguous() for t in model.state_dict().values()]
    dropout = next((m for m in model.modules() if isinstance(m, nn.Dropout)), nn.Dropout(0.5))
    return {"weights": b"".join(t.numpy().tobytes() for t in weights),
            "flat": torch.cat([t.flatten().float() for t in weights]) if weights else None,
            "torch": dropout.train()(torch.ones(MASK)) != 0,
            "numpy": np.random.random(DRAWS), "python": [random.random() for _ in range(DRAWS)]}


def _drive(ctx: Any, fn: Callable, name: str) -> list[dict[str, Any]]:
    _fresh_process()
    out = []
    for seed in SEEDS:
        with learner_part(ctx, name):
            model = fn(seed, ctx.rank, make_model)
        out.append(_draws(model))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def _ranks(ranks: list[int]) -> str:
    *most, last = ranks
    return f"rank {last}" if not most else f"ranks {', '.join(map(str, most))} and {last}"


def check_seeding(fn: Callable, *, timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Run `fn(seed, rank, make_model)` on 2 ranks, twice, and report on its streams:
    check_seeding(build_for_rank).ok."""
    name = getattr(fn, "__name__", "your function")
    report = Report(f"{name}: initial weights and random streams on {WORLD} gloo ranks, run twice",
                    implementation=fn)
    runs = []
    for run in (1, 2):
        outcomes = run_checked(report, functools.partial(_drive, fn=fn, name=name),
                               world_size=WORLD, timeout=timeout, name=f"check-{name}-run{run}",
                               runs_root=runs_root)
        if outcomes is None:
            return report
        runs.append(outcomes)
    for rank, outcome in enumerate(runs[0]):
        if "returned" in outcome[0]:
            report.add("runs", "fail", f"rank {rank}: {name} returned a {outcome[0]['returned']}, "
                                       "not the model make_model() built: return it", part=name)
            return report
    repeat = _repeats(report, runs, name)
    if not repeat:       # the weights differ run to run: a difference between ranks proves nothing
        return report
    _weights(report, runs[0], name)
    _noise(report, runs[0], repeat, name)
    _seed_used(report, runs[0], name)
    return report


def _repeats(report: Report, runs: list, name: str) -> set[str]:
    """The streams that gave every rank the same draws in both runs of the first seed; empty when
    the weights themselves did not repeat."""
    first, second = [[outcome[0] for outcome in outcomes] for outcomes in runs]
    moved = [r for r in range(WORLD) if first[r]["weights"] != second[r]["weights"]]
    if moved:
        if len(moved) == WORLD:
            said = (f"the same seed ({SEEDS[0]}) twice built other initial weights on every rank: "
                    "nothing seeds torch before make_model() (a process torchrun starts draws from "
                    "OS entropy); seed it from `seed`")
        else:
            kept = [r for r in range(WORLD) if r not in moved]
            said = (f"{_ranks(moved)} built other initial weights in a second run with the same "
                    f"seed, {_ranks(kept)} the same: only some ranks are seeded (an `if rank == "
                    "0:` around the seed?); seed every rank")
        report.add("repeats", "fail", said, part=name)
        return set()
    repeat = {"weights"}
    for stream, what in STREAMS.items():
        moved = [r for r in range(WORLD) if not _same(first[r][stream], second[r][stream])]
        if moved:
            report.add("repeats", "fail", f"the same seed twice gave {_ranks(moved)} other "
                                          f"{what}: {SEEDERS[stream]}", part=name)
        else:
            repeat.add(stream)
    if len(repeat) == len(STREAMS) + 1:
        report.add("repeats", "pass", "the same seed twice: every rank's weights and draws "
                                      "repeat, bit for bit")
    return repeat


def _weights(report: Report, outcomes: list, name: str) -> None:
    zero = outcomes[0][0]
    for rank in range(1, WORLD):
        mine = outcomes[rank][0]
        if mine["weights"] != zero["weights"]:
            comparable = mine["flat"] is not None and zero["flat"] is not None \
                and mine["flat"].shape == zero["flat"].shape
            gap = (mine["flat"] - zero["flat"]).abs().max().item() if comparable else float("nan")
            report.add("weights", "fail", f"rank {rank}'s initial weights differ from rank 0's "
                                          f"(largest gap {gap:.3g}): the seed before make_model() "
                                          "depends on the rank. Seed every rank alike before "
                                          "building, and per rank only after", part=name)
            return
    report.add("weights", "pass", f"every rank built the same initial weights, byte for byte "
                                  f"({len(zero['weights']):,} bytes)")


def _noise(report: Report, outcomes: list, repeat: set[str], name: str) -> None:
    zero = outcomes[0][0]
    for stream, what in STREAMS.items():
        shared = [r for r in range(1, WORLD) if _same(outcomes[r][0][stream], zero[stream])]
        if stream in repeat and shared:   # a stream that did not repeat was named already
            report.add("noise", "fail", f"ranks 0 and {shared[0]} draw the same {what}: one seed "
                                        "everywhere gives every rank the same noise for its "
                                        "different samples. After building, seed a stream of each "
                                        "rank's own (seeds.seed_everything(seed, rank=rank))",
                       part=name)
            return
    if not set(STREAMS) <= repeat:      # a stream that varies run to run cannot be judged here
        return
    agree = (outcomes[1][0]["torch"] == zero["torch"]).float().mean().item()
    report.add("noise", "pass", f"the ranks draw their own noise: their dropout masks agree at "
                                f"{agree:.0%} of {MASK:,} positions, as independent masks do")


def _seed_used(report: Report, outcomes: list, name: str) -> None:
    one, other = outcomes[0]
    for what, key in (("initial weights", "weights"), ("dropout masks", "torch")):
        if _same(one[key], other[key]):
            report.add("seed", "fail", f"seed={SEEDS[0]} and seed={SEEDS[1]} gave rank 0 the same "
                                       f"{what}: the seed argument is not used (a constant seed?)",
                       part=name)
            return
    report.add("seed", "pass", f"another seed ({SEEDS[1]}) gives other weights and other masks")
