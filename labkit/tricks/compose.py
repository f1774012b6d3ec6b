"""Lesson 25's toolbox: composing DP x TP x CP by hand on one DeviceMesh, and what each rank then holds and sends.

    model = gpt2_ready(config)                 # tinylm's GPT-2, its blocks' Conv1D as nn.Linear (same function)
    parallelize_module(block, mesh["tp"], block_plan()); local_heads(block, 2)    # one block, TP over 2 ranks
    context_attention(model, mesh["cp"].get_group())                              # its attention over the CP ranks
    fully_shard(model, mesh=flat(mesh, "dp", "cp"))                               # FSDP2 over dp x cp
    held_formula(config)                       # bytes of parameters each rank holds, parameter by parameter
    ring_bytes_formula(config)                 # bytes each rank's ring attention sends in one forward

The helpers are labkit's own pieces (training/parallel/tensor_parallel.py, context_model.py) under names a learner can
read; the composition, in which order and over which mesh dimensions, is the learner's (exercises/checks_compose.py).
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..config import RunConfig
from ..training.parallel.context_model import split_attention
from ..training.parallel.tensor_parallel import block_plan as _block_plan
from ..training.parallel.tensor_parallel import linear_gpt2
from ..training.tasks import make_task


def gpt2_ready(config: RunConfig) -> nn.Module:
    """tinylm's GPT-2 for `config` (seeded by config.seed), each block's layers as nn.Linear, q, k and v apart, so
    that torch's ColwiseParallel and RowwiseParallel can split them:  gpt2_ready(RunConfig(layers=2))."""
    import torch
    torch.manual_seed(config.seed)
    return linear_gpt2(make_task(config, 1).build_model())


def block_plan() -> dict:
    """The tensor-parallel plan of one block (Megatron-LM's): q, k, v and the MLP's first layer column-wise, the two
    output projections row-wise; for torch's parallelize_module(block, tp_mesh, block_plan())."""
    return _block_plan(sequence_parallel=False)


def local_heads(block: nn.Module, tp: int) -> None:
    """Tell a split block's attention the width of its own share of q, k and v (heads / tp heads each)."""
    block.attn.split_size = block.attn.embed_dim // tp


def context_attention(model: nn.Module, group: Any, method: str = "ring") -> Any:
    """Make `model`'s attention context-parallel over `group` (labkit's ring, all-gather or Ulysses attention; torch's
    own refuses causal attention on CPU); returns the Traffic its forwards add to."""
    return split_attention(model, group=group, method=method)


def flat(mesh: Any, *names: str) -> Any:
    """The 1-D mesh over several dimensions of `mesh` together (FSDP2 and DDP take one):  flat(mesh, "dp", "cp")."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


def held_formula(config: RunConfig, model: nn.Module | None = None) -> int:
    """Bytes of fp32 parameters one rank holds under config's dims, FSDP2 over dp x cp and TP inside each block,
    worked out parameter by parameter: a block matrix is cut into tp slices along its split dimension, then every
    tensor into dp x cp row shards, each padded to ceil(rows / n) rows as FSDP2 pads."""
    dims = config.parallel_dims
    model = model if model is not None else gpt2_ready(config)
    n, held = dims.dp * dims.cp, 0
    for name, param in model.named_parameters():
        shape = list(param.shape)
        split = _tp_dim(name)
        if split is not None and dims.tp > 1:
            shape[split] //= dims.tp
        held += math.ceil(shape[0] / n) * math.prod(shape[1:]) * 4
    return held


def _tp_dim(name: str) -> int | None:
    """The dimension tensor parallelism cuts a GPT-2 block parameter along (nn.Linear's [out, in]): column-wise
    layers their outputs (dim 0, their bias too), row-wise layers their inputs (dim 1; their bias stays whole)."""
    if ".attn.c_attn." in name or ".mlp.c_fc." in name:
        return 0
    if name.endswith("c_proj.weight"):
        return 1
    return None


def ring_bytes_formula(config: RunConfig) -> int:
    """Bytes one rank's ring attention sends in one forward: per layer and sample, its K and V ((s/c) x (h/t) values
    each, its own heads only under TP) to each of the c - 1 others: 2 (c - 1) (s/c) (h/t) x 4 bytes, times the
    layers and the samples it reads."""
    dims = config.parallel_dims
    width = make_task(config, 1).build_model().config.hidden_size
    samples = dims.batch_per_rank(config.global_batch, config.grad_accum)
    return 2 * (dims.cp - 1) * (config.seq_len // dims.cp) * (width // dims.tp) * 4 * config.blocks * samples
