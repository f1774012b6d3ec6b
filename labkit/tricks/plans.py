"""transformers' own tensor- and expert-parallel plans for DeepSeek-V3, beside how labkit splits the same weights.

    from labkit.tricks import deepseek, plans
    plans.plans_table()                       # one row per module either side splits; "differs" says why
    plans.plans_table(deepseek.lesson_config("ZeRO-3 + TP"))   # in_model: which rows the lesson's model has

transformers (5.x) ships a plan with each model: DeepseekV3Config.base_model_tp_plan and base_model_ep_plan map
module patterns ("layers.*.mlp.experts.gate_up_proj") to style names ("packed_colwise"), which
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., ep_size=...))` applies; the causal-LM
class adds its head's (`_tp_plan`). labkit splits with its own code: training/parallel/moe_tp.py (TP, torch's
parallelize_module) and training/parallel/experts.py with moe_layout.py (EP). Both sides are read at run time:
transformers' strings from its classes, the effect of each style from the class transformers registered for it;
labkit's from moe_tp.layer_plan on a DeepSeek-V3 of the lesson's sizes (with one dense layer, so that the dense MLP's
rows are read too) and from ExpertBank's slices of a fused experts module. Only the reasons are written here.
"""
from __future__ import annotations

import re

import pandas as pd
import torch

from ..config import RunConfig
from ..training.moe_task import moe_model_config
from ..training.parallel import moe_tp
from ..training.parallel.experts import ExpertBank

__all__ = ["plans_table", "transformers_plans", "labkit_effects", "effect", "EFFECTS", "REASONS", "WHOLE"]

OUT = "output features"
IN = "input features"
WHOLE = "whole on every rank"
ROPE = "whole; the rotary key's gradient summed over the TP ranks"
PARTIAL = "a slice of every expert per rank; outputs all-reduced"
EXPERTS = "whole experts, a block of them per rank (dim 0)"
TOKENS = "tokens travel to their experts' ranks"

EFFECTS = {"ColwiseParallel": OUT, "RowwiseParallel": IN, "MoeExpertsParallel": PARTIAL,
           "EpDispatchExpertsParallel": TOKENS, "MlaKvAProjParallel": ROPE}
"""What a transformers style class does to the weights it is given (styles with parameters are read in `effect`)."""

NOT_NAMED = "(not named)"
EXPERTS_WHOLE = ("labkit keeps routed experts whole under TP: V3 splits them by EP (the ep rows), and TP on them "
                 "all-reduces every token's MoE output")
ATTENTION = "transformers' V3 plan splits no attention; labkit splits it as its V2 plan does (deepseek_v2)"
REASONS = {("tp", "layers.*.mlp.experts.gate_up_proj"): EXPERTS_WHOLE,
           ("tp", "layers.*.mlp.experts.down_proj"): EXPERTS_WHOLE,
           ("tp", "layers.*.mlp.experts"): EXPERTS_WHOLE,
           ("tp", "lm_head"): "labkit keeps the head whole (moe_tp's plan: small, the same on both ranks)",
           ("tp", "layers.*.self_attn.q_b_proj"): ATTENTION, ("tp", "layers.*.self_attn.kv_b_proj"): ATTENTION,
           ("tp", "layers.*.self_attn.o_proj"): ATTENTION,
           ("tp", f"layers.*.self_attn.{moe_tp.ROPE_SOURCE}"): ATTENTION + "; the rotary key it makes is shared by "
                                                                 "the split heads: its gradient is summed"}
"""Why labkit splits a weight otherwise than transformers' DeepSeek-V3 plans, by (plan, module pattern)."""


def transformers_plans() -> dict[str, dict[str, str]]:
    """{"tp": {pattern: style}, "ep": {pattern: style}, "tp_v2": ...} as transformers' DeepSeek classes declare
    them now: base_model_tp_plan plus the causal LM's _tp_plan (its head), base_model_ep_plan."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    return {"tp": {**(DeepseekV3Config.base_model_tp_plan or {}), **(DeepseekV3ForCausalLM._tp_plan or {})},
            "ep": dict(DeepseekV3Config.base_model_ep_plan or {}),
            "tp_v2": {**(DeepseekV2Config.base_model_tp_plan or {}), **(DeepseekV2ForCausalLM._tp_plan or {})}}


def effect(style: str | None) -> str:
    """What transformers' style `style` does to a weight, from the class it registered under that name:
    effect("colwise") == "output features"; None (the plan names no style) -> whole on every rank."""
    if style is None:
        return WHOLE
    from transformers.distributed import expert_parallel, tensor_parallel  # noqa: F401 (they register the styles)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    layer = ALL_PARALLEL_STYLES[style]
    kind = type(layer).__name__
    if kind == "PackedColwiseParallel":   # a _StridedShard: each of the packed parts split over the ranks
        return f"{OUT}, a slice of each of its {layer.split_factor} packed parts (gate, up)"
    if kind == "MoEParamShard":
        dim = getattr(layer.placement, "dim", None)
        return EXPERTS if dim == 0 and layer.shards_expert_dim else f"{layer.placement} of each expert tensor"
    return EFFECTS.get(kind, f"{kind} (effect not recorded)")


def _meta_model(config: RunConfig, dense_first: bool = False) -> torch.nn.Module:
    """config's DeepSeek-V3 on the meta device (no parameters allocated, no RNG); dense_first: its first layer made
    dense, so that the dense MLP's rows are read too."""
    from transformers import DeepseekV3ForCausalLM
    model_config = moe_model_config(config)
    if dense_first:
        model_config.first_k_dense_replace = 1
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(model_config)


def labkit_effects(config: RunConfig) -> dict[tuple[str, str], str]:
    """{(plan, pattern): what labkit does to that weight}: "tp" from moe_tp.layer_plan (and sum_rope_gradient's
    module), "ep" from ExpertBank.from_fused, the copy of its experts each rank of an EP group keeps."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    model = _meta_model(config, dense_first=True)
    tp: dict[tuple[str, str], str] = {}
    for layer in moe_tp.decoder_layers(model):
        for path, style in moe_tp.layer_plan(layer).items():
            done = OUT if isinstance(style, ColwiseParallel) else IN if isinstance(style, RowwiseParallel) else None
            if done is not None:   # PrepareModuleInput only lays out an input: it splits nothing
                tp[("tp", f"layers.*.{path}")] = done
    tp[("tp", f"layers.*.self_attn.{moe_tp.ROPE_SOURCE}")] = ROPE
    return {**tp, **_ep_effects(config)}


def _ep_effects(config: RunConfig) -> dict[tuple[str, str], str]:
    """Where ExpertParallel goes (the MoE's `experts`) and how ExpertBank cuts the fused parameters it replaces:
    experts a..b-1 of gate_up_proj [E, 2I, H] and down_proj [E, H, I], read back from a bank's copies."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    fused = DeepseekV3Experts(moe_model_config(config))   # torch.empty parameters: filled below, no RNG used
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p))
    first = fused.num_experts // 2
    bank = ExpertBank.from_fused(fused, range(first, fused.num_experts))   # the second rank's share of two
    out = {}
    for name in ("gate_up_proj", "down_proj"):
        whole = all(torch.equal(getattr(e, name), getattr(fused, name)[first + i]) for i, e in enumerate(bank.experts))
        out[("ep", f"layers.*.mlp.experts.{name}")] = EXPERTS if whole else "a part of each expert"
    # ExpertParallel takes the fused module's place in each DeepseekV3MoE (moe_layout.split_experts_over)
    out[("ep", "layers.*.mlp.experts")] = TOKENS
    return out


def _in_model(pattern: str, names: list[str]) -> bool:
    """Whether `pattern` (a plan key: base-model relative, "*" for a layer number; or "lm_head") names a module or
    parameter among `names` (the causal LM's)."""
    body = re.escape(pattern).replace(r"\*", r"\d+")
    wanted = re.compile(rf"(?:model\.)?{body}")
    return any(wanted.fullmatch(name) for name in names)


def plans_table(config: RunConfig | None = None) -> pd.DataFrame:
    """plans_table(lesson_config("ZeRO-3 + TP")): one row per (plan, module pattern) that transformers' DeepSeek-V3
    plans name or labkit splits. Columns: plan ("tp" or "ep"); module; transformers (its style string, NOT_NAMED
    where its plan does not name the module); deepseek_v2 (transformers' DeepSeek-V2 TP style for it); transformers
    splits and labkit splits (what each does to the weight); in_model (the model of `config` has it); differs (why
    the two split it otherwise, from REASONS; "" where they agree). `config`: lesson 21's "ZeRO-3 + TP" run."""
    if config is None:
        from .deepseek import lesson_config
        config = lesson_config("ZeRO-3 + TP")
    plans, ours = transformers_plans(), labkit_effects(config)
    keys = [("tp", k) for k in plans["tp"]] + [("ep", k) for k in plans["ep"]]
    keys += [key for key in ours if key not in keys]
    names = _module_and_parameter_names(config)
    rows = []
    for plan, module in keys:
        style = plans[plan].get(module)
        theirs, mine = effect(style), ours.get((plan, module), WHOLE)
        reason = "" if theirs == mine else REASONS.get((plan, module), "differs: no reason recorded")
        v2 = plans["tp_v2"].get(module) if plan == "tp" else None
        rows.append({"plan": plan, "module": module, "transformers": style or NOT_NAMED,
                     "deepseek_v2": v2 or NOT_NAMED,
                     "transformers splits": theirs, "labkit splits": mine,
                     "in_model": _in_model(module, names), "differs": reason})
    return pd.DataFrame(rows)


def _module_and_parameter_names(config: RunConfig) -> list[str]:
    """Every module's and parameter's name in config's model."""
    model = _meta_model(config)
    return [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
