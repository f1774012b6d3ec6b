"""ZeRO-3 and ZeRO-2 with torch's FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded.

    mesh = init_device_mesh("cpu", (world,))
    shard_model(model, mesh, reshard_after_forward=True)     # ZeRO-3: gather each block for forward, again for
                                                             # backward, free it after each
    shard_model(model, mesh, reshard_after_forward=False)    # ZeRO-2's traffic: gather once per step, keep the
                                                             # full parameters from forward until backward ends
    optimizer = torch.optim.AdamW(model.parameters())        # over the shards: its state is sharded too

`fully_shard` turns every parameter into a DTensor sharded on dim 0 (each rank keeps 1/N of its rows, padded to
an equal size) and groups them per module it is applied to: one all-gather per group before that module runs,
one reduce-scatter of its gradients after backward. Applied to each GPT-2 block and then to the whole model (the
root group: embeddings, final LayerNorm, LM head), as FSDP2's documentation advises (bottom-up), so that only one
block's full parameters need exist at a time under ZeRO-3.

ZeRO-2 as the paper has it keeps a full copy of the parameters on every rank all the time and shards gradients
and optimizer state only. FSDP2 has no such mode; `reshard_after_forward=False` comes closest: the same traffic
as ZeRO-2 (one all-gather, one reduce-scatter per step: as much as DDP's all-reduce) and the full parameters held
through forward and backward, resharded after backward.

On a mesh of two dimensions (data x tensor parallel), pass the data-parallel sub-mesh: FSDP then shards the
tensor-parallel DTensors further over it (strategies.py, "fsdp+tp").
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

from torch import nn

# FSDP2 warns about transformers' ModelOutput (not a plain tensor, so no module backward hook) and about the
# root returning a view; neither applies to how labkit's loop uses the output (a loss, never modified in place).
QUIET = (r"For backward hooks to be called, module output should be a Tensor",
         r"FSDP2-wrapped module .* returned a view tensor",
         r"Full backward hook is firing when gradients are computed with respect to module outputs")


def shard_model(model: nn.Module, mesh: Any, *, reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard each transformer block (if the model has .transformer.h), then the whole model; in place.
    Returns the model (now also an FSDPModule)."""
    from torch.distributed.fsdp import fully_shard
    quiet_warnings()
    blocks = list(getattr(getattr(model, "transformer", None), "h", []))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


class Sharded:
    """The model as labkit's loop calls it: forward as usual, plus DDP's `no_sync()` for gradient accumulation.

    Like DDP's, the choice is made when forward runs: a forward inside `no_sync()` sets FSDP2's
    set_requires_gradient_sync(False), so the backward that follows (inside or after the block) keeps its
    gradients local; the next forward outside it turns syncing back on."""

    def __init__(self, model: nn.Module, fsdp_root: Any = None):
        self.module = model
        self.fsdp_root = fsdp_root  # None: nothing to hold back (pure tensor parallelism)
        self._sync = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fsdp_root is not None:
            self.fsdp_root.set_requires_gradient_sync(self._sync)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True


def quiet_warnings() -> None:
    for message in QUIET:
        warnings.filterwarnings("ignore", message=message)
