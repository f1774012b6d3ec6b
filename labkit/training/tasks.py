"""Built-in tasks: a model, a deterministic data stream, and a loss.

    task = make_task(cfg)                  # cfg.task: "tinylm", "digits" or "tinymoe" (moe_task.py)
    model = task.build_model()
    inputs, targets = task.batch(step=0, micro=0, rank=1)   # this rank's slice of the global batch
    loss, extras = task.loss(model, inputs, targets)

The global batch of a step depends only on (seed, step), never on the world size: rank r's micro-batch m is rows
[(m * world + r) * B, ... + B) of it. So 2 ranks x batch B see exactly the samples 1 rank x batch 2B sees, which is
what makes DDP comparable to a single process.

tinylm: a tiny GPT-2 (transformers, random init, offline) on a synthetic language where every token is followed by
one of `branching` tokens, uniformly at random. No model can beat ln(branching) nats per token: `loss_floor`.
digits: an MLP on scikit-learn's bundled 8x8 digits (1437 train / 360 held-out images), with accuracy.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .data import DigitsStream, digits_data, digits_indices, step_generator
from .moe_task import TinyMoE
from .taskbase import Task
from ..config import RunConfig
from ..rules import LAYERS, LM_HEADS

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub: the models are built from a config
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LANGUAGE_SEED = 20261130  # the synthetic language is fixed; RunConfig.seed only changes which sentences are drawn
LM_SIZES = {size: (width, LAYERS["tinylm"][size], LM_HEADS[size])   # width, layers, heads
            for size, width in (("tiny", 64), ("small", 128), ("base", 256))}
MLP_WIDTH = {"tiny": 64, "small": 128, "base": 256}


class TinyLM(Task):
    def __init__(self, config: RunConfig, world_size: int | None = None):
        super().__init__(config, world_size)
        self.vocab, self.k, self.seq_len = config.vocab_size, config.branching, config.seq_len
        self.successors = successor_table(self.vocab, self.k)
        self.loss_floor = config.loss_floor
        self.tokens_per_sample = self.seq_len

    def build_model(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel
        width, layers, heads = LM_SIZES[self.config.model_size]
        layers = self.config.layers or layers  # RunConfig.layers: deeper, for pipelines of stages
        cfg = GPT2Config(vocab_size=self.vocab, n_positions=self.seq_len, n_embd=width, n_layer=layers,
                         n_head=heads, resid_pdrop=self.config.dropout, embd_pdrop=self.config.dropout,
                         attn_pdrop=self.config.dropout,  # 0 unless asked for (RunConfig.dropout)
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = sample_sentences(self.successors, self.config.global_batch, self.seq_len + 1,
                                  step_generator(self.config.seed, step), self.rows(micro, rank))
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)), {}


def successor_table(vocab: int, branching: int) -> torch.Tensor:
    """[vocab, branching]: the tokens allowed after each token (distinct, fixed by LANGUAGE_SEED)."""
    g = torch.Generator().manual_seed(LANGUAGE_SEED + 7919 * vocab + branching)
    return torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])


def sample_sentences(successors: torch.Tensor, total_rows: int, length: int, generator: torch.Generator,
                     rows: slice) -> torch.Tensor:
    """Rows `rows` of a [total_rows, length] batch of sentences; every row is the same whatever slice is asked."""
    vocab, k = successors.shape
    # Draw the randomness for all rows, so a row's sentence does not depend on which rows this rank takes.
    first = torch.randint(vocab, (total_rows,), generator=generator)[rows]
    choices = torch.randint(k, (total_rows, length - 1), generator=generator)[rows]
    tokens = torch.empty(first.shape[0], length, dtype=torch.long)
    tokens[:, 0] = first
    for t in range(1, length):
        tokens[:, t] = successors[tokens[:, t - 1], choices[:, t - 1]]
    return tokens


class Digits(Task):
    def __init__(self, config: RunConfig, world_size: int | None = None):
        super().__init__(config, world_size)
        self.x_train, self.y_train, self.x_test, self.y_test = digits_data()
        self._streams: dict[int, Any] = {}  # rank -> data.DigitsStream, made on first use (in the rank)

    def build_model(self) -> nn.Module:
        width = MLP_WIDTH[self.config.model_size]
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 10))

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.data_workers or self.config.sample_cost_ms:
            return self._stream(rank).batch(step, micro)  # the DataLoader pipeline: the same rows, same order
        index = digits_indices(self.config.seed, len(self.x_train), self.config.global_batch, step,
                               self.rows(micro, rank))
        return self.x_train[index], self.y_train[index]

    def close(self) -> None:
        """Stop any DataLoader workers now (they also stop after the run's last batch)."""
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    def _stream(self, rank: int) -> Any:
        if rank not in self._streams:
            self._streams[rank] = DigitsStream(self.config, self.world_size, rank, self.x_train, self.y_train)
        return self._streams[rank]

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits = model(inputs)
        accuracy = (logits.argmax(-1) == targets).float().mean().item()
        return F.cross_entropy(logits.float(), targets), {"accuracy": accuracy}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        logits = model(self.x_test)
        return {"eval_accuracy": (logits.argmax(-1) == self.y_test).float().mean().item()}


TASKS = {"tinylm": TinyLM, "digits": Digits, "tinymoe": TinyMoE}


def make_task(config: RunConfig, world_size: int | None = None) -> Task:
    """The task named by config.task, sliced for `world_size` ranks (default: config.world_size)."""
    return TASKS[config.task](config, world_size)


def preload(config: RunConfig) -> None:
    """Import or load, in the launching process, what a task needs, so forked ranks start warm."""
    if config.task == "tinylm":
        from transformers import GPT2LMHeadModel  # noqa: F401 - import cost paid once, before forking
    elif config.task == "tinymoe":
        from transformers import DeepseekV3ForCausalLM  # noqa: F401
    elif config.task == "digits":
        digits_data()
