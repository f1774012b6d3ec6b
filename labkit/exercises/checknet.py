"""The model and data the checkers train: small, but with the traps real models set for hand-written DDP and ZeRO.

    model = CheckNet()                    # a tied weight (embed.weight is head.weight) and a frozen layer
    inputs, targets = check_batch(step=0, rank=1, world_size=2)     # rank 1's rows of step 0's global batch
    loss = check_loss(model, inputs, targets)

- `head.weight` IS `embed.weight` (as in GPT-2): one tensor, two names. `module.parameters()` yields it once;
  `named_parameters(remove_duplicate=False)` and walking submodules one by one yield it twice.
- `frozen` has requires_grad=False: no gradient, nothing to all-reduce, no optimizer state; still part of the model,
  so every rank must start from rank 0's copy of it.
- The global batch of a step depends only on the step: rank r of N takes rows [r*B/N, (r+1)*B/N). Every rank has the
  same number of rows, so the mean of the ranks' mean losses is the global batch's mean loss, and the average of the
  ranks' gradients is the single-process gradient. That is what every checker compares against.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, DEPTH, SEQ, GLOBAL_BATCH = 32, 32, 3, 8, 8
DATA_SEED = 4242


class CheckNet(nn.Module):
    """Embedding -> frozen linear -> residual tanh blocks -> output layer tied to the embedding."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.embed(tokens))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def build_checknet(seed: int) -> CheckNet:
    """A CheckNet initialised from `seed` (the checkers give each rank its own seed, as separate processes get)."""
    torch.manual_seed(seed)
    return CheckNet()


def global_batch_for(world_size: int) -> int:
    """The checkers' global batch on `world_size` ranks: GLOBAL_BATCH, or the next multiple of the world size (9 rows
    on 3 ranks), so that every rank gets the same number of rows:  global_batch_for(3) -> 9."""
    return -(-GLOBAL_BATCH // world_size) * world_size


def check_batch(step: int, rank: int, world_size: int, global_batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
    """Rank `rank`'s rows of step `step`'s global batch (all of it for world_size=1): (inputs, targets). The
    checkers pass global_batch=global_batch_for(world_size), and the same to their one-process reference."""
    if global_batch % world_size:
        raise ValueError(f"global_batch = {global_batch} does not split over world_size = {world_size}: "
                         "pick a batch that is a multiple of the world size")
    generator = torch.Generator().manual_seed(DATA_SEED + step)
    tokens = torch.randint(VOCAB, (global_batch, SEQ + 1), generator=generator)
    rows = global_batch // world_size
    mine = tokens[rank * rows:(rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def check_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_names(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it goes by (a tied parameter has several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter, by its first name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def grad_snapshot(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of every parameter's gradient (None where there is none), by the parameter's first name."""
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def trainable_bytes(model: nn.Module) -> int:
    """Bytes of one gradient of every parameter that requires one, each tensor counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
