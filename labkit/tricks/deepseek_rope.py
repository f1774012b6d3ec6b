"""A silent trap of tensor parallelism on MLA attention: the rotary key is shared by the heads that TP splits over a
pair of ranks, so its gradient is partial on each and must be summed over the pair (moe_tp.sum_rope_gradient does).
Left out, a pair's copies of it drift apart while every loss still falls.

    from labkit.tricks import deepseek_rope
    trap = deepseek_rope.rope_trap(steps=4)            # ZeRO-3 + TP with the sum left out, on real ranks
    deepseek_rope.pair_disagreement(trap)              # > 0: the two ranks of a TP pair no longer agree
    deepseek_rope.pair_disagreement(runs["ZeRO-3 + TP"])   # 0.0 with the sum in place
    deepseek_rope.ROPE_SOURCE                           # "kv_a_proj_with_mqa": the module whose outputs hold the key
"""
from __future__ import annotations

from typing import Any

from ..records import Run
from ..run.launch import launch
from ..training.parallel.moe_tp import ROPE_SOURCE
from .deepseek import lesson_config

__all__ = ["ROPE_SOURCE", "without_rope_sum", "rope_trap", "pair_disagreement"]


def without_rope_sum(ctx: Any) -> None:
    """A rank of labkit's loop with moe_tp's rotary-key gradient sum left out: launch(without_rope_sum, config=cfg)."""
    from ..training.loop import train
    from ..training.parallel import moe_tp
    moe_tp.sum_rope_gradient = lambda attn, mesh: None   # this rank's copy of the module only (a forked process)
    train(ctx)


def rope_trap(*, steps: int, runs_root: Any = None) -> Run:
    """The article's layout trained with the rotary key's gradient left partial on each TP rank."""
    config = lesson_config("ZeRO-3 + TP", steps=steps, name="ZeRO-3 + TP, rotary key not summed")
    return launch(without_rope_sum, config=config, echo=False, runs_root=runs_root, timeout=120)


def pair_disagreement(run: Run) -> float:
    """The largest loss difference between the two ranks of a TP pair (ranks 2i and 2i+1), over every step: ranks
    of a pair compute on the same rows with the same weights, so it is 0 when their weights stay equal."""
    losses = run.df.pivot(index="step", columns="rank", values="loss")
    return float(max((losses[r] - losses[r + 1]).abs().max() for r in range(0, losses.shape[1], 2)))
