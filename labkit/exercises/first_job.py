"""labkit's reference for lesson 24's first exercise: join the job torchrun started, all-reduce, print, leave.

    torchrun --standalone --nproc-per-node 2 first_job.py
"""
import os

import torch
import torch.distributed as dist


def main():
    """Join the job from torchrun's environment, all-reduce rank + 1, print one line, leave."""
    rank = int(os.environ["RANK"])              # this process's rank in the whole job
    world = int(os.environ["WORLD_SIZE"])       # how many processes the job has
    local_rank = int(os.environ["LOCAL_RANK"])  # its index on this node: which GPU is its own
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # env:// reads MASTER_ADDR and MASTER_PORT (where rank 0 listens), RANK and WORLD_SIZE
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)                      # SUM over the ranks: 1 + 2 + ... + world
    print(f"rank {rank}/{world} local_rank {local_rank} device {device} sum {total.item():g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
