"""A plain DDP training script, written the way people write their own (no labkit inside):

    torchrun --nproc-per-node 2 examples/plain_ddp.py --steps 8
    python -m labkit watch --timeout 10 -- torchrun --nproc-per-node 2 examples/plain_ddp.py --bug rank0-collective

--bug puts in one mistake that real jobs make, on one rank:
    rank0-collective   a barrier under `if rank == 0`, after rank 0 saves a checkpoint (the others never join it)
    skip-batch         rank 1 skips a "bad" batch with `continue` (one optimizer step fewer: a hang at the end)
    slow-rank          rank 1 sleeps before each step (a straggler: everyone waits for it)
    nan-rank           rank 1 reads a sample holding a NaN at step 3 (its loss goes NaN; DDP spreads the gradients)
Each rank prints one line per step: "rank R step S loss L" (L with every digit, to compare with the records).
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

BUGS = ("none", "rank0-collective", "skip-batch", "slow-rank", "nan-rank")
FEATURES = 16


def build(seed: int = 0) -> torch.nn.Module:
    """The model, the same on every rank (DDP also broadcasts rank 0's weights at start)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def batch(rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at this step: different on each rank, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, FEATURES, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.25


def train(rank: int, steps: int, bug: str = "none", lr: float = 0.05, log=print, slow_s: float = 0.15,
          save_to: str = os.path.join(tempfile.gettempdir(), "plain_ddp_checkpoint.pt")) -> None:
    """The loop; `log(step, loss)` is called once per step (the script prints)."""
    model = DistributedDataParallel(build())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = batch(rank, step)
        if bug == "skip-batch" and rank == 1 and step == 2:
            continue                                      # "this batch looks bad, skip it", on one rank only
        if bug == "slow-rank" and rank == 1:
            time.sleep(slow_s)                            # a slow disk, a busy neighbour, a thermal throttle
        if bug == "nan-rank" and rank == 1 and step == 3:
            x[0, 0] = float("nan")                        # one bad sample: a NaN in the inputs
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if bug == "rank0-collective" and rank == 0 and step == 2:
            torch.save(model.module.state_dict(), save_to)  # a checkpoint, written by rank 0 only...
            dist.barrier()                                # ...and "wait until it is written": under the same if
        log(step, loss)
    dist.barrier()                                        # leave together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bug", choices=BUGS, default="none")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train(rank, args.steps, args.bug, args.lr,
          log=lambda step, loss: print(f"rank {rank} step {step} loss {loss.item()!r}", flush=True))
    gc.collect()   # free DDP (its hooks form cycles) while the interpreter is whole, then the process group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
