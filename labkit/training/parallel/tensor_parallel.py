"""Tensor parallelism (Megatron-LM's split of each block's matrices) for transformers' GPT-2, with DTensor.

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    linear_gpt2(model)                   # Conv1D -> nn.Linear, the fused QKV as three projections; same function
    split_blocks(model, mesh)            # each block's attention and MLP split over the mesh's ranks
    split_blocks(model, mesh, sequence_parallel=True)   # and the LayerNorms over pieces of the sequence

**Why GPT-2 needs adapting first.** transformers' GPT-2 computes with `Conv1D` modules: a linear layer whose weight
is stored transposed ([in, out], where nn.Linear keeps [out, in]). torch's ColwiseParallel / RowwiseParallel
know nn.Linear and nn.Embedding only. And attention's `c_attn` is one fused Conv1D producing [q | k | v] side by
side: cutting its outputs into two halves would give rank 0 all of q and half of k, not half of each. So
`linear_gpt2` rebuilds each block with nn.Linear layers holding the same numbers (transposed), the fused QKV
becoming three projections q, k, v (`SplitQKV`); the model computes the same function (to rounding).

**The plan (Megatron-LM, Shoeybi et al. 2019).** In each block:
    attention   q, k, v column-wise (each rank computes whole heads: heads/T of them), c_proj row-wise
    MLP         c_fc column-wise (a slice of the hidden units, GELU applies elementwise), c_proj row-wise
A row-wise layer's partial outputs are summed by an all-reduce: two in forward per block. In backward, the
gradient of each column-wise input is partial on every rank: one all-reduce for the MLP's input and one for the
attention's (q, k and v share their input: `PrepareModuleInput` makes it one DTensor, so their three partial
gradients are summed locally first and all-reduced once). Embeddings, LayerNorms and the LM head stay replicated.

**Sequence parallelism (Korthikanti et al. 2022, section 4.2.2).** What the plan above keeps whole on every rank
between the split parts (the LayerNorms, their inputs, the residual additions) works on each position alone, so
with `sequence_parallel=True` each rank keeps s/T positions of it: `SequenceParallel()` on ln_1 and ln_2, the
column-wise parts take a sequence-sharded input (`Shard(1)`: an all-gather before them, a reduce-scatter of the
gradient in backward), the row-wise parts leave one (a reduce-scatter in place of the all-reduce; an all-gather in
backward). The same bytes as the all-reduces: an all-reduce is a reduce-scatter and an all-gather. At the ends of
the stack of blocks: the embeddings' dropout output is cut into the pieces (each rank keeps its own; no message;
all-gathered in backward), and the final LayerNorm runs on the pieces, whose output is all-gathered for the LM head
(tied to the embedding, whole on every rank). A LayerNorm's weight gradient is then a sum over the pieces of the
sequence, which DTensor leaves pending: a hook sums it (one all-reduce per weight and bias) as soon as backward has
produced it, so that the gradient norm, clipping and the optimizer see the whole gradient.

**Attention's local head count.** After the split each rank's q/k/v hold heads/T heads. GPT2Attention reshapes
with -1 heads, so it finds the local count from the tensor; what it must be told is the local width of each of
q, k, v (`split_size`), which `split_blocks` sets to width/T.
"""
from __future__ import annotations

import torch
from torch import nn


class SplitQKV(nn.Module):
    """GPT-2's fused c_attn as three nn.Linear projections; returns [q | k | v] concatenated as c_attn did."""

    def __init__(self, width: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden), self.k(hidden), self.v(hidden)], dim=-1)


def linear_gpt2(model: nn.Module) -> nn.Module:
    """Replace the Conv1D layers of every GPT-2 block by nn.Linear (c_attn by SplitQKV), in place, keeping the
    values:  linear_gpt2(GPT2LMHeadModel(config)). Returns the model."""
    for block in _blocks(model):
        width = block.attn.embed_dim
        qkv = SplitQKV(width)
        weight, bias = block.attn.c_attn.weight.detach(), block.attn.c_attn.bias.detach()  # [in, 3 out], [3 out]
        with torch.no_grad():
            for i, projection in enumerate((qkv.q, qkv.k, qkv.v)):
                projection.weight.copy_(weight[:, i * width:(i + 1) * width].t())
                projection.bias.copy_(bias[i * width:(i + 1) * width])
        block.attn.c_attn = qkv
        block.attn.c_proj = _as_linear(block.attn.c_proj)
        block.mlp.c_fc = _as_linear(block.mlp.c_fc)
        block.mlp.c_proj = _as_linear(block.mlp.c_proj)
    return model


def block_plan(sequence_parallel: bool = False) -> dict:
    """The DTensor plan for one adapted GPT-2 block (module path inside the block -> how it is split); with
    `sequence_parallel`, its LayerNorms run on each rank's piece of the sequence (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    arrives = Shard(1) if sequence_parallel else Replicate()      # the block's activations between the matrices
    plan = {
        "attn.c_attn": PrepareModuleInput(input_layouts=(arrives,), desired_input_layouts=(Replicate(),)),
        "attn.c_attn.q": ColwiseParallel(), "attn.c_attn.k": ColwiseParallel(), "attn.c_attn.v": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(output_layouts=arrives),
        "mlp.c_fc": ColwiseParallel(input_layouts=arrives), "mlp.c_proj": RowwiseParallel(output_layouts=arrives),
    }
    if sequence_parallel:
        plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel()})
    return plan


def split_blocks(model: nn.Module, mesh: object, *, sequence_parallel: bool = False) -> nn.Module:
    """Split every (adapted) GPT-2 block over the 1-D `mesh` (tensor parallelism), in place:
    split_blocks(linear_gpt2(model), mesh). With sequence_parallel=True the LayerNorms, the residual stream and the
    final LayerNorm work on each rank's piece of the sequence (sequence parallelism). Returns the model."""
    from torch.distributed.tensor.parallel import parallelize_module
    degree = mesh.size()
    for block in _blocks(model):
        attn = block.attn
        if not isinstance(attn.c_attn, SplitQKV):
            raise TypeError("split_blocks needs the adapted model: call linear_gpt2(model) first (GPT-2's fused "
                            "Conv1D c_attn cannot be split column-wise)")
        if attn.num_heads % degree:
            raise ValueError(f"{attn.num_heads} attention heads do not split over {degree} ranks; use a tensor-"
                             "parallel degree that divides the head count")
        parallelize_module(block, mesh, block_plan(sequence_parallel))
        attn.split_size = attn.embed_dim // degree  # the local width of each of q, k, v
    if sequence_parallel:
        _split_sequence_ends(model, mesh)
        for norm in [m for b in _blocks(model) for m in (b.ln_1, b.ln_2)] + [model.transformer.ln_f]:
            for param in norm.parameters():
                param.register_post_accumulate_grad_hook(_sum_pieces)
    return model


def _sum_pieces(param: nn.Parameter) -> None:
    """A LayerNorm's gradient under sequence parallelism is a sum still to be taken (each rank has its piece of
    the sequence's contribution): one all-reduce makes it whole, before the norm, the clipping and the step."""
    from torch.distributed.tensor import Replicate
    if param.grad is not None and any(p.is_partial() for p in param.grad.placements):
        param.grad = param.grad.redistribute(placements=[Replicate()] * len(param.grad.placements))


def _split_sequence_ends(model: nn.Module, mesh: object) -> None:
    """Where the sequence is cut and joined: after the embeddings (at their dropout, the last module every rank
    runs on the whole sequence: each keeps its piece, no message; with dropout the mask was drawn for the whole
    sequence first, as in one process) and after the final LayerNorm (which runs on the pieces; the LM head, tied
    to the embedding, gets the whole sequence back: one all-gather)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel, parallelize_module
    transformer = model.transformer
    parallelize_module(transformer.drop, mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                   desired_output_layouts=Shard(1)))
    parallelize_module(transformer.ln_f, mesh, SequenceParallel())
    parallelize_module(transformer.ln_f, mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                   desired_output_layouts=Replicate()))


def _as_linear(conv: nn.Module) -> nn.Linear:
    """transformers' Conv1D(nf, nx) (weight [nx, nf]) as nn.Linear(nx, nf) with the same values."""
    linear = nn.Linear(conv.nx, conv.nf)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    return linear


def _blocks(model: nn.Module) -> list[nn.Module]:
    """A GPT-2's blocks, or a pipeline stage's (pipeline.GPT2Stage keeps its share in .h)."""
    if isinstance(getattr(model, "h", None), nn.ModuleList):
        return list(model.h)
    transformer = getattr(model, "transformer", None)
    if transformer is None or not hasattr(transformer, "h"):
        raise TypeError(f"{type(model).__name__} is not a transformers GPT-2 model (no .transformer.h blocks): "
                        "tensor parallelism here splits GPT-2 blocks (task 'tinylm')")
    return list(transformer.h)
