"""The "plateau" schedule: torch's ReduceLROnPlateau, fed a held-out loss that every rank agrees on.

    plateau = Plateau(cfg, task, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
    lr = lr_for_config(step, cfg, peak=plateau.lr)        # warmup, then the plateau's current LR
    if plateau.due(step):
        fields = plateau.evaluate(model)                  # {"eval_loss": 1.52, "eval_loss_rank": 1.49}

The held-out set is fixed (tinylm: HELDOUT_SENTENCES sentences drawn from a stream no training step uses; digits:
the 360 test images) and shared out over the ranks, as a distributed evaluation does: each rank measures its own
shard. The mean over all shards needs one all-reduce; the scheduler is fed that (`eval_loss`). With
RunConfig.plateau_per_rank each rank's scheduler is fed its own shard's loss (`eval_loss_rank`) instead: the shards
differ, so the schedulers cut the LR at different steps, and the ranks train with different LRs while DDP still
averages their gradients. Run.lr_disagreement() names the first step where the records show it.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from ..config import RunConfig
from .tasks import Digits, Task, TinyLM, sample_sentences

HELDOUT_SENTENCES = 64        # tinylm's held-out set, shared out over the ranks
HELDOUT_SEED = 2**45 + 2027   # its sentences' stream: far from every training step's (data.step_generator)


def shard(n: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous share of n held-out rows:  shard(64, 1, 2) -> slice(32, 64)."""
    return slice(rank * n // world_size, (rank + 1) * n // world_size)


def heldout_batch(task: Task, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the task's held-out set (the same rows in every run)."""
    if isinstance(task, TinyLM):
        rows = shard(HELDOUT_SENTENCES, rank, world_size)
        tokens = sample_sentences(task.successors, HELDOUT_SENTENCES, task.seq_len + 1,
                                  torch.Generator().manual_seed(HELDOUT_SEED), rows)
        return tokens[:, :-1], tokens[:, 1:]
    if isinstance(task, Digits):
        rows = shard(len(task.x_test), rank, world_size)
        return task.x_test[rows], task.y_test[rows]
    raise TypeError(f"no held-out set for {type(task).__name__}")


class Plateau:
    """ReduceLROnPlateau on a stand-in optimizer whose one LR is the schedule's current peak."""

    def __init__(self, config: RunConfig, task: Task, *, rank: int, world_size: int, device: torch.device):
        self.config, self.task, self.device = config, task, device
        self.inputs, self.targets = (t.to(device) for t in heldout_batch(task, rank, world_size))
        stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            stand_in, mode="min", factor=config.plateau_factor, patience=config.plateau_patience,
            min_lr=config.lr * config.min_lr_ratio)

    @property
    def lr(self) -> float:
        return self.scheduler.optimizer.param_groups[0]["lr"]

    def due(self, step: int) -> bool:
        """Whether the held-out loss is measured after this step (every eval_every steps)."""
        return (step + 1) % self.config.eval_every == 0

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Measure the held-out loss, feed the scheduler (the all-reduced mean, or this rank's own: the bug)."""
        loss, _ = self.task.loss(model, self.inputs, self.targets)
        own = loss.item()
        fed = own
        if not self.config.plateau_per_rank:
            total = torch.tensor([own * len(self.inputs), len(self.inputs)], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            fed = (total[0] / total[1]).item()
        self.scheduler.step(fed)
        return {"eval_loss": fed, "eval_loss_rank": own}
