"""The article's layout for tinymoe: ZeRO-3 + tensor parallelism on transformers' DeepSeek-V3 ("fsdp+tp", a 2-D mesh).

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    split_deepseek(model, mesh["tp"])        # MLA's head projections and the shared expert over the TP pair
    shard_deepseek(model, mesh["dp"])        # then FSDP2 (ZeRO-3) over the data-parallel ranks, layer by layer
    # strategies.distribute does both for RunConfig(task="tinymoe", strategy="fsdp+tp", world_size=4)

**The plan** (Megatron-LM's, on DeepSeek-V3's modules; `layer_plan`). In each decoder layer:
    attention       q_b_proj and kv_b_proj column-wise (each rank makes the queries, keys and values of half the
                    heads from the shared low-rank latents), o_proj row-wise (the partial outputs all-reduced)
    shared expert   gate_proj and up_proj column-wise, down_proj row-wise (a slice of its hidden units each)
    kept whole      the low-rank down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms, the router, the
                    RMSNorms, embeddings and head: small, and the same on both ranks
    routed experts  whole on both ranks of a TP pair, FSDP-sharded over the data-parallel ranks (below)
transformers 5.24's DeepseekV3Attention works with a local head count: it views q as (batch, seq, -1, qk_head_dim),
the expanded kv as (batch, seq, -1, nope + v) and the output as (batch, seq, -1), so a column-wise split on a head
boundary just gives it fewer heads; nothing needs telling (GPT-2 needed its split_size set).

**The rotary key, a gradient TP would lose.** MLA's positional key k_rot comes out of the kept-whole
kv_a_proj_with_mqa and is shared by every head. Each rank's attention uses it for its own heads only, so the
gradient each rank sends back into it is a partial sum over half the heads, and nothing in the column-wise layers
adds the halves (they all-reduce the gradients of *their* inputs: the latents). Left alone, the two ranks train
kv_a_proj_with_mqa on different gradients and drift apart. `sum_rope_gradient` adds a forward hook that routes
k_rot through a DTensor marked Replicate whose gradient is Partial: forward unchanged, one all-reduce of its
gradient in backward (Megatron's "f" operator), as the column-wise layers do for the latents.

**Why the routed experts are not split.** transformers keeps all experts of a layer in two fused 3-D parameters,
gate_up_proj [E, 2I, H] and down_proj [E, H, I], and runs them through grouped_mm; the gate and up halves of
gate_up_proj lie one after the other on dim 1 (`chunk(2)` separates them). A plain column-wise split of dim 1 would
give one rank every gate and the other every up. transformers' own DeepSeek-V3 plan (base_model_tp_plan) does not
do that: its `packed_colwise` style shards gate_up_proj with a _StridedShard(dim=1, split_factor=2), which cuts
dim 1 into its 2 packed parts first and then each part over the ranks, so rank r holds rows r*I/T..(r+1)*I/T of the
gate and the same rows of the up, side by side, and the local chunk(2) still separates a matching gate and up;
down_proj goes `rowwise` (its I columns), and `moe_tp_experts` all-reduces the experts' partial outputs. No rebuild
of the parameter is needed there. labkit does not split them over the TP pair, for V3's reason: experts are where
DeepSeek-V3 uses expert parallelism instead (base_model_ep_plan's `grouped_gemm`: whole experts per rank, as
experts.py does), because each token uses a few experts, and splitting every expert's matrices adds an all-reduce
of every token's MoE output per layer, and another of its input gradient in backward. So here they stay whole on
both ranks of a TP pair (both compute them on the same tokens) and FSDP shards them over the data-parallel ranks
along the expert dimension (E/dp experts' rows each), gathered for forward and backward as every other parameter
is. Both TP ranks then hold and compute identical experts: the price of the article's layout for an MoE, measured
in the lesson. labkit.tricks.plans sets this plan beside transformers' own, row by row (transformers' V3 plan also
leaves attention whole; its DeepSeek-V2 plan splits it as this one does, rotary key included: its `mla_kv_a_proj`
does what sum_rope_gradient does, an all-reduce of the rotary key's gradient in backward).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


ROPE_SOURCE = "kv_a_proj_with_mqa"
"""The attention module whose last qk_rope_head_dim outputs are the rotary key every head shares (sum_rope_gradient)."""


def layer_plan(layer: nn.Module) -> dict:
    """The DTensor plan for one DeepseekV3DecoderLayer (module path inside the layer -> how it is split)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    attn = layer.self_attn
    plan = {f"self_attn.{'q_b_proj' if attn.q_lora_rank is not None else 'q_proj'}": ColwiseParallel(),
            "self_attn.kv_b_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}
    # the shared expert of a MoE layer; a dense layer's (first_k_dense_replace) MLP is split the same way
    path = "mlp.shared_experts" if hasattr(layer.mlp, "shared_experts") else "mlp"
    # gate and up read one input: one DTensor for both, so their partial input gradients are summed locally and
    # all-reduced once (as GPT-2's q, k, v in tensor_parallel.py)
    plan[path] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    plan.update({f"{path}.gate_proj": ColwiseParallel(), f"{path}.up_proj": ColwiseParallel(),
                 f"{path}.down_proj": RowwiseParallel()})
    return plan


def split_deepseek(model: nn.Module, mesh: Any) -> nn.Module:
    """Split every decoder layer of a transformers DeepSeek-V3 over the 1-D `mesh` (tensor parallelism), in place;
    returns the model. Refuses a head count the mesh does not divide."""
    from torch.distributed.tensor.parallel import parallelize_module
    degree = mesh.size()
    for layer in decoder_layers(model):
        heads = layer.self_attn.num_heads
        if heads % degree:
            raise ValueError(f"{heads} attention heads do not split over {degree} tensor-parallel ranks; use a "
                             "degree that divides the head count")
        parallelize_module(layer, mesh, layer_plan(layer))
        sum_rope_gradient(layer.self_attn, mesh)
    return model


def sum_rope_gradient(attn: nn.Module, mesh: Any) -> Any:
    """Make the gradient of MLA's shared rotary key (the last qk_rope_head_dim outputs of kv_a_proj_with_mqa) a
    sum over the tensor-parallel ranks (see the module docstring); returns the hook's handle."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    latent = attn.kv_lora_rank

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        kept, rope = out[..., :latent], out[..., latent:]
        rope = DTensor.from_local(rope, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        return torch.cat([kept, rope], dim=-1)
    return getattr(attn, ROPE_SOURCE).register_forward_hook(hook)


def shard_deepseek(model: nn.Module, mesh: Any, *, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 (fully_shard) on each decoder layer, then the whole model (embeddings, final norm, head); in place.
    Non-DTensor parameters (the routed experts, the router, the norms) are sharded over `mesh` on dim 0."""
    from torch.distributed.fsdp import fully_shard
    from .fullshard import quiet_warnings
    quiet_warnings()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise TypeError(f"{type(model).__name__} is not a transformers DeepSeek-V3 model (no .model.layers)")
    return list(inner.layers)


def split_parameters(model: nn.Module) -> dict[str, bool]:
    """{parameter name: whether the plan splits it over the tensor-parallel ranks}, for an unsplit model:
    what labkit.tricks.deepseek's formulas count."""
    split = set()
    for layer in decoder_layers(model):
        for path in layer_plan(layer):
            module = layer.get_submodule(path)
            if isinstance(module, nn.Linear):
                split.add(id(module.weight))
    return {name: id(p) in split for name, p in model.named_parameters()}
