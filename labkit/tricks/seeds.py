"""Seeds and reproducibility (lesson 08): the seeding tools labkit's loop uses, for your own rank functions.

    from labkit.tricks import seeds
    seeds.seed_everything(1234)                  # Python, NumPy, torch: the same everywhere (initial weights)
    seeds.seed_everything(1234, rank=ctx.rank)   # a stream of its own per rank (dropout, augmentation)
    seeds.rank_seed(1234, ctx.rank)              # that rank's seed, for a torch.Generator of its own
    seeds.rng_fingerprint()                      # short digests of the three generator states, to compare ranks
    seeds.set_deterministic(True); seeds.determinism_switches()   # ask torch for deterministic kernels; read back
    seeds.agreement(mask0, mask1)                # the share of positions where two ranks drew the same
    seeds.streams_figure()                       # the picture: which streams are shared, which are per rank

The seeding implementations live with the loop that calls them (labkit/training/seeding.py); this is the lesson's
door, with the lesson's picture.
"""
from __future__ import annotations

import torch
from matplotlib.figure import Figure

from ..training.seeding import determinism_switches, rank_seed, rng_fingerprint, seed_everything, set_deterministic
from ..view import COLORS, new_figure, shown

__all__ = ["seed_everything", "rank_seed", "rng_fingerprint", "set_deterministic", "determinism_switches",
           "agreement", "streams_figure"]


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of positions where a and b hold the same value:  agreement(mask0, mask1) -> 0.49.

    Two independent masks that keep each position with probability 1/2 agree about half the time; one stream
    shared by both ranks gives 1.0."""
    if a.shape != b.shape:
        raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)}: compare draws of the same shape")
    return (a == b).float().mean().item()


@shown
def streams_figure(world_size: int = 2) -> Figure:
    """The lesson's picture: per rank, a timeline of the random streams. One seed shared by all ranks builds the
    model; DDP then broadcasts rank 0's weights; after that each rank draws its noise from a stream of its own."""
    fig = new_figure(figsize=(11, 1.1 + 0.9 * world_size))
    ax = fig.subplots()
    shared = "#999999"
    for rank in range(world_size):
        y = world_size - 1 - rank
        ax.barh(y, 3.0, left=0.0, height=0.6, color=shared)
        ax.text(1.5, y, "torch.manual_seed(1234)\nbuild the model", ha="center", va="center", fontsize=8)
        ax.barh(y, 4.0, left=4.0, height=0.6, color=COLORS[rank % len(COLORS)], alpha=0.8)
        ax.text(6.0, y, f"Generator(rank_seed(1234, {rank}))\nrank {rank}'s own dropout, crops, noise",
                ha="center", va="center", fontsize=8, color="white")
        ax.text(-0.15, y, f"rank {rank}", ha="right", va="center", fontsize=9)
        if rank:
            ax.annotate("", xy=(3.5, y + 0.3), xytext=(3.5, world_size - 1 - 0.3),
                        arrowprops=dict(arrowstyle="->", color="black"))
    ax.text(3.5, world_size - 0.55, "DDP(model):\nrank 0's weights to all", ha="center", va="bottom", fontsize=8)
    ax.set(xlim=(-1.2, 8.2), ylim=(-0.6, world_size + 0.2))
    ax.axis("off")
    ax.set_title("same stream for the weights (grey), a stream per rank for the noise (colours)", fontsize=10)
    return fig
