"""What every task provides: a model, this rank's slice of a deterministic global batch, and a loss.

    class MyTask(Task):                     # tasks.py and moe_task.py hold the built-in ones
        def build_model(self): ...
        def batch(self, step, micro, rank): ...     # rows self.rows(micro, rank) of step's global batch
        def loss(self, model, inputs, targets): ... # (loss, extras recorded with the step)

    task.model_fields(model)    # what MFU needs, recorded with each rank's first step (Run.model(), Run.mfu())
"""
from __future__ import annotations

import torch
from torch import nn
from ..config import RunConfig


class Task:
    """Shared slicing of the global batch; subclasses provide the data, the model and the loss."""

    loss_floor: float | None = None
    tokens_per_sample: int = 0

    def __init__(self, config: RunConfig, world_size: int | None = None):
        self.config = config
        self.world_size = world_size or config.world_size
        self.batch_size = config.global_batch // (self.world_size * config.grad_accum)

    def rows(self, micro: int, rank: int) -> slice:
        start = (micro * self.world_size + rank) * self.batch_size
        return slice(start, start + self.batch_size)

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}

    def model_fields(self, model: nn.Module) -> dict[str, int]:
        """The whole model's parameter counts and shape, the fields MFU needs (labkit.measure.mfu):
        model_params          every parameter (a tied one once)
        model_params_embedding  the lookup tables, which no matmul uses: position embeddings, and the token
                              embeddings unless tied to the output layer (then they are its matmul's weight)
        model_params_active   the parameters one token uses: all of them, but an MoE's idle experts (idle_params)
        model_layers, model_hidden, model_seq_len   the shape, for the attention term (token models only)"""
        params = {id(p): p for p in model.parameters()}
        total = sum(p.numel() for p in params.values())
        output = getattr(model, "get_output_embeddings", lambda: None)()
        tied = {id(output.weight)} if output is not None else set()
        lookups = sum(m.weight.numel() for m in model.modules()
                      if isinstance(m, nn.Embedding) and id(m.weight) not in tied)
        fields = {"model_params": total, "model_params_active": total - self.idle_params(model),
                  "model_params_embedding": lookups}
        shape = getattr(model, "config", None)
        if shape is not None and self.tokens_per_sample:
            fields.update(model_layers=shape.num_hidden_layers, model_hidden=shape.hidden_size,
                          model_seq_len=self.tokens_per_sample)
        return fields

    def idle_params(self, model: nn.Module) -> int:
        """Parameters a token does not use (an MoE's experts it is not routed to); none in a dense model."""
        return 0
