"""tinymoe: a toy DeepSeek-V3 (transformers' own architecture) on a mixture of synthetic languages.

    cfg = RunConfig(task="tinymoe", world_size=2, experts=8, top_k=2, balancing="bias")
    run = labkit.launch(cfg)                   # records expert_load, maxvio, lm_loss, ... per step and rank

    task = TinyMoE(cfg)                        # in a rank, as labkit's loop does (tasks.make_task)
    model = task.build_model()                 # DeepseekV3ForCausalLM: MLA attention, every layer a MoE layer
    loss, extras = task.loss(model, *task.batch(step=0, micro=0, rank=0))

The data: `languages` languages, each on its own slice of the vocabulary (vocab_size / languages tokens) with its
own successor table (`branching` successors per token, uniformly). A sentence is one language throughout, drawn
with probability proportional to (l + 1) ** -language_skew. No model beats ln(branching) nats per token, and a
router can tell the languages apart from any single token: something for experts to specialise in.

The model (transformers 5.24's DeepseekV3Config): first_k_dense_replace=0, so every layer is a MoE layer (the
default, 3, would leave a 2-layer toy without any); config.experts routed experts and one shared expert; the
sigmoid router with group-limited routing (n_group = expert_groups, topk_group = group_top_k); multi-head latent
attention with low-rank q and kv; no multi-token prediction layers. Built from a config, offline.

`loss` is the language-model loss plus, with balancing "aux", the balance loss; extras carry lm_loss (the loss
without it) and the routing fields of training/routing.py.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .data import step_generator
from .routing import Routing
from .taskbase import Task
from ..config import RunConfig

LANGUAGE_SEED = 20261201
MOE_SIZES = {"tiny": (32, 2), "small": (64, 4), "base": (128, 4)}  # width, heads; layers: RunConfig.blocks


def language_tables(vocab: int, languages: int, branching: int) -> torch.Tensor:
    """[languages, vocab / languages, branching]: the tokens allowed after each token, in global token ids
    (language l owns tokens l * V/L .. (l + 1) * V/L - 1, and its successors stay inside)."""
    size = vocab // languages
    g = torch.Generator().manual_seed(LANGUAGE_SEED + 7919 * vocab + 31 * languages + branching)
    return torch.stack([torch.stack([torch.randperm(size, generator=g)[:branching] for _ in range(size)]) + l * size
                        for l in range(languages)])


def language_weights(languages: int, skew: float) -> torch.Tensor:
    """Probability of each language: proportional to (l + 1) ** -skew."""
    w = (torch.arange(languages, dtype=torch.float64) + 1) ** -skew
    return (w / w.sum()).float()


def sample_mixture(tables: torch.Tensor, weights: torch.Tensor, total_rows: int, length: int,
                   generator: torch.Generator, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of a [total_rows, length] batch of sentences and their languages; a row is the same whichever
    slice asks for it (all rows' randomness is drawn, then sliced)."""
    languages, size, k = tables.shape
    language = torch.multinomial(weights, total_rows, replacement=True, generator=generator)[rows]
    first = torch.randint(size, (total_rows,), generator=generator)[rows]
    choices = torch.randint(k, (total_rows, length - 1), generator=generator)[rows]
    tokens = torch.empty(first.shape[0], length, dtype=torch.long)
    tokens[:, 0] = first + language * size
    for t in range(1, length):
        local = tokens[:, t - 1] - language * size
        tokens[:, t] = tables[language, local, choices[:, t - 1]]
    return tokens, language


def moe_model_config(config: RunConfig) -> Any:
    """transformers' DeepseekV3Config for a RunConfig (task "tinymoe")."""
    from transformers import DeepseekV3Config
    (width, heads), layers = MOE_SIZES[config.model_size], config.blocks
    head = width // heads
    return DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, first_k_dense_replace=0,
        n_routed_experts=config.experts, n_shared_experts=1, moe_intermediate_size=width // 2,
        num_experts_per_tok=config.top_k, n_group=config.expert_groups, topk_group=config.group_top_k,
        q_lora_rank=width // 2, kv_lora_rank=width // 4, qk_nope_head_dim=head // 2, qk_rope_head_dim=head // 2,
        v_head_dim=head // 2, max_position_embeddings=max(64, config.seq_len + 16), num_mtp_layers=0,
        bos_token_id=0, eos_token_id=0, pad_token_id=None)


class TinyMoE(Task):
    def __init__(self, config: RunConfig, world_size: int | None = None):
        super().__init__(config, world_size)
        self.seq_len = config.seq_len
        self.tables = language_tables(config.vocab_size, config.languages, config.branching)
        self.weights = language_weights(config.languages, config.language_skew)
        self.loss_floor = config.loss_floor
        self.tokens_per_sample = self.seq_len
        self.routing: Routing | None = None

    def build_model(self) -> nn.Module:
        from transformers import DeepseekV3ForCausalLM
        model = DeepseekV3ForCausalLM(moe_model_config(self.config))
        self.routing = Routing(model, self.config)
        return model

    def idle_params(self, model: nn.Module) -> int:
        """The routed experts a token is not sent to: (experts - top_k) / experts of each layer's routed experts
        (`mlp.experts`, all experts' weights in a few tensors; the shared expert and the router work for every
        token)."""
        routed = sum(p.numel() for name, module in model.named_modules() if name.split(".")[-1] == "experts"
                     for p in module.parameters())
        return routed // self.config.experts * (self.config.experts - self.config.top_k)

    def sentences(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, seq_len + 1], language [B]) of this rank's rows of step's batch."""
        return sample_mixture(self.tables, self.weights, self.config.global_batch, self.seq_len + 1,
                              step_generator(self.config.seed, step), self.rows(micro, rank))

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing is not None:
            self.routing.start_step(step)
        tokens, _ = self.sentences(step, micro, rank)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits = model(input_ids=inputs).logits
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        aux = self.routing.take_aux_loss() if self.routing is not None else 0.0
        extras = {"lm_loss": lm.item(), "aux_loss": float(aux.detach()) if torch.is_tensor(aux) else aux}
        if self.routing is not None:
            extras.update(self.routing.fields())
        return lm + aux, extras
