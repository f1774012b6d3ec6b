"""transformers' DeepSeek-V3 (tinymoe) cut into pipeline stages: what pipeline.py's cut does for GPT-2.

    stages = split_deepseek(model, 2)       # [embeddings + layer 0, layer 1 + norm + head] for a 2-layer model
    logits = stages[1](stages[0](input_ids))   # chained, the whole model's forward (to rounding)

A stage is some consecutive decoder layers, with the token embedding if first and the final RMSNorm and LM head if
last. DeepseekV3Model.forward (transformers 5.24) computes, once for all layers: the position ids (0..seq-1 without
a cache), the causal mask (`create_causal_mask`, which returns None when the attention kernel can be told
`is_causal` instead, as sdpa can) and the rotary embeddings (cos, sin) from its `rotary_emb`, then calls each layer
as layer(hidden, position_embeddings=..., attention_mask=..., position_ids=...). Only hidden states travel between
stages, so every stage recomputes the three from the hidden states it receives (they depend on the sequence
length only: no parameters, nothing to send), with the same calls, and calls its layers the same way. The rotary
module holds buffers only; each stage refers to the one model's module.
"""
from __future__ import annotations

import torch
from torch import nn


class DeepseekStage(nn.Module):
    """Some consecutive decoder layers of a transformers DeepseekV3ForCausalLM, with the embedding if first and the
    final norm and head if last."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.first, self.last, self.blocks = first, last, layers
        self.config = inner.config
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.norm, self.lm_head = (inner.norm, model.lm_head) if last else (None, None)
        self.__dict__["rotary_emb"] = inner.rotary_emb  # not a submodule: buffers only, the model's own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask
        hidden = self.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=rotary, attention_mask=mask, position_ids=positions)
        return self.lm_head(self.norm(hidden)) if self.last else hidden


def split_deepseek(model: nn.Module, stages: int) -> list[DeepseekStage]:
    """Cut a DeepSeek-V3 into `stages` stages of equal numbers of layers:  split_deepseek(model, 2)[1].layers."""
    n = len(model.model.layers)
    if n % stages:
        raise ValueError(f"{n} decoder layers do not split evenly into {stages} stages; use RunConfig.layers = a "
                         f"multiple of {stages}")
    per = n // stages
    return [DeepseekStage(model, range(s * per, (s + 1) * per), first=s == 0, last=s == stages - 1)
            for s in range(stages)]


def is_deepseek(model: nn.Module) -> bool:
    return hasattr(getattr(model, "model", None), "layers") and hasattr(model.model, "rotary_emb")
