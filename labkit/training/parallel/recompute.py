"""Activation recomputation: keep only each transformer block's input in forward, run the block again in backward.

    recompute_blocks(model, "full")     # each GPT-2 block wrapped in torch's checkpoint_wrapper (non-reentrant)
    recompute_blocks(model, "none")     # nothing: 0 blocks wrapped

torch.utils.checkpoint runs a block's forward without saving what autograd would keep for backward, saves the
block's inputs, and runs the forward again when backward reaches the block. Activation memory per layer falls from
the saved tensors of every matmul, norm and activation to the block's input (Korthikanti et al. 2022, "full"
recomputation), for one more forward: about a third more matmul FLOPs.

The wrapper is torch's `checkpoint_wrapper` (torch.distributed.algorithms._checkpoint), the way torchtitan applies
it: after tensor parallelism has rebuilt the blocks and before `fully_shard`, so that FSDP2's hooks sit outside the
recomputed region (the recomputation finds the block's parameters already gathered for backward). The wrapper
strips its own prefix from state-dict keys: a checkpoint saved with recomputation loads without it, and back.
The RNG state is kept and restored around the recomputation (preserve_rng_state), so dropout draws the same mask.
"""
from __future__ import annotations

from torch import nn

from ...rules import RECOMPUTE


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks recomputation wraps: GPT-2's model.transformer.h."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no .transformer.h blocks to recompute (GPT-2's tinylm has)")
    return blocks


def recompute_blocks(model: nn.Module, how: str) -> int:
    """Wrap every block of `model` for recomputation, in place, as `how` says ("none" or "full"); returns the
    number of blocks wrapped."""
    if how not in RECOMPUTE:
        raise ValueError(f"recompute = {how!r}: must be one of {RECOMPUTE}")
    if how == "none":
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    blocks = blocks_of(model)
    # No key/value cache threaded through a block that runs twice: training never reads it.
    model.config.use_cache = False
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return len(blocks)
