"""Lesson 00's first step, started by launchers other than labkit (bench/first_launch.py): the work is labkit's, only
the start differs.

Each rank joins a gloo group, builds transformers' tiny GPT-2 as labkit's tinylm task does (vocabulary 64, 32
positions, width 64, 2 layers, 4 heads), wraps it in DistributedDataParallel (whose first construction imports
torch._dynamo in a process that has not), takes one AdamW step on 16 sentences of 32 tokens, and rank 0 writes the
wall time at which that step ended to $FIRST_STEP_OUT. labkit's side is `labkit.launch(RunConfig(world_size=2,
steps=3))`, lesson 00's first launch, which does this and records it. Nothing here imports labkit (its import
would be a cost labkit's rivals do not pay), and everything is importable by spawned children (bench/ is on their
sys.path), so nothing is defined in a notebook cell.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ, WIDTH, LAYERS, HEADS, BATCH_PER_RANK = 64, 32, 64, 2, 4, 16  # labkit's tinylm, model_size="tiny"


def first_step(rank: int) -> None:
    """Build the DDP GPT-2 and take one optimizer step; rank 0 notes when it ended."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = DDP(GPT2LMHeadModel(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(VOCAB, (BATCH_PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    logits = model(input_ids=tokens[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    optimizer.step()
    if rank == 0:
        Path(os.environ["FIRST_STEP_OUT"]).write_text(repr(time.time()))


def plain_rank(rank: int, world: int, port: int) -> None:
    """A rank started by multiprocessing (fork) or torch.multiprocessing.spawn: its own group over tcp://."""
    torch.set_num_threads(1)  # as labkit's ranks: one core each (and no fork-after-threads hang)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    first_step(rank)
    dist.destroy_process_group()


def accelerate_rank() -> None:
    """A rank started by accelerate's notebook_launcher, which sets RANK, WORLD_SIZE, MASTER_ADDR/PORT."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    first_step(int(os.environ["RANK"]))
    dist.destroy_process_group()


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the launchers that need one are told it; labkit's ranks pick their own)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
