"""What each MoE router decided, and load balancing: counts, capacity dropping, the aux loss, DeepSeek's bias.

    routing = Routing(model, config)        # taps every DeepseekV3TopkRouter of a transformers DeepSeek-V3 model
    routing.start_step(step)                # counts are per optimizer step (all its micro-batches)
    loss = lm_loss + routing.take_aux_loss()            # balancing "aux": alpha * sum over layers of f_i * P_i
    routing.attach(optimizer, world_size)   # balancing "bias"/"bias_per_rank": update the biases before each step
    routing.fields()                        # record fields: expert_load, maxvio, dropped, expert_bias
    routing.fields_after_step()             # bias_after: each router's bias after this rank's update

transformers' router (DeepseekV3TopkRouter) scores experts with a sigmoid, adds `e_score_correction_bias` (a
buffer) to choose experts, and weighs the chosen ones by the unbiased scores. Nothing in transformers changes the
bias: DeepSeek-V3's auxiliary-loss-free balancing does it outside the model, after every optimizer step:
bias_i += gamma * sign(mean load - load_i), so an overloaded expert gets chosen less next time. The loads must be
counted over every token of the step, on every rank (an all-reduce), which is why it lives in an optimizer
pre-step hook (as torchtitan does): it runs once per optimizer step, after all micro-batches of accumulation.

A forward hook on each router reads its choice (topk_indices) and may change its output: with a capacity factor,
assignments past an expert's capacity get weight 0 (exactly what dropping them does to the output; sigmoid
weights are never 0 otherwise, so the expert-parallel dispatch reads weight 0 as "dropped" and does not send it).

MaxVio (DeepSeek-V3's balance measure): max load / mean load - 1 of a layer; `maxvio` records the worst layer.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from ..config import RunConfig


def max_violation(load: torch.Tensor) -> torch.Tensor:
    """MaxVio per row of `load` [..., experts]: max / mean - 1 (0 when perfectly balanced; 0 for an empty row)."""
    mean = load.float().mean(-1)
    return torch.where(mean > 0, load.float().amax(-1) / mean.clamp_min(1e-12) - 1, torch.zeros_like(mean))


def capacity_keep(indices: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """[tokens, k] bool: which assignments fit in their expert's capacity, ceil(factor * tokens * k / experts),
    first come first served in token order (GShard, Switch):  capacity_keep(topk_indices, 8, 1.25)."""
    tokens, k = indices.shape
    capacity = math.ceil(factor * tokens * k / experts)
    flat = indices.reshape(-1)
    onehot = torch.nn.functional.one_hot(flat, experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many earlier assignments went to the same expert
    return (position < capacity).view(tokens, k)


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, before alpha: mean over sequences of
    sum_i f_i * P_i, with f_i = experts / (k * T) * (tokens choosing i) and P_i = mean over tokens of i's
    normalised score. scores [tokens, experts] (sigmoid, with gradient), indices [tokens, k]."""
    experts, k = scores.shape[-1], indices.shape[-1]
    s = (scores / scores.sum(-1, keepdim=True)).view(batch, -1, experts)
    chosen = torch.zeros_like(scores).scatter_(1, indices, 1.0).view(batch, -1, experts)
    f = chosen.mean(1) * experts / k
    return (f * s.mean(1)).sum(-1).mean()


class Routing:
    """Taps on every router of `model` (see the module docstring). Counts live on the CPU, as plain tensors."""

    def __init__(self, model: nn.Module, config: RunConfig):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.config = config
        self.experts = config.experts
        layers = len(self.routers)
        self.load = torch.zeros(layers, self.experts)       # assignments the routers asked for, this step
        self.kept = torch.zeros(layers, self.experts)       # of which fit in capacity
        self.bias_used = torch.zeros(layers, self.experts)  # the bias each router chose with, this step
        self.step = None
        self._aux: list[torch.Tensor] = []
        self.bias_steps = 0
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def start_step(self, step: int) -> None:
        """A new optimizer step begins (called with each batch; only a new step number resets the counts)."""
        if step != self.step:
            self.step = step
            self.load.zero_()
            self.kept.zero_()

    def _hook(self, layer: int) -> Any:
        def hook(router: nn.Module, inputs: tuple, output: tuple) -> tuple:
            logits, weights, indices = output
            counts = torch.bincount(indices.reshape(-1).cpu(), minlength=self.experts).float()
            self.load[layer] += counts
            self.bias_used[layer] = router.e_score_correction_bias.detach().float().cpu()
            if self.config.balancing == "aux" and router.training:
                batch = inputs[0].shape[0] if inputs[0].dim() == 3 else 1
                self._aux.append(sequence_balance_loss(logits.sigmoid(), indices, batch))
            if self.config.capacity_factor is None:
                self.kept[layer] += counts
                return output
            keep = capacity_keep(indices, self.experts, self.config.capacity_factor)
            self.kept[layer] += torch.bincount(indices[keep].cpu(), minlength=self.experts).float()
            return logits, weights * keep, indices
        return hook

    def take_aux_loss(self) -> torch.Tensor | float:
        """alpha * (sum over layers of the balance loss) of the forwards since the last call; 0.0 without "aux"."""
        aux, self._aux = self._aux, []
        return self.config.aux_alpha * torch.stack(aux).sum() if aux else 0.0

    def attach(self, optimizer: torch.optim.Optimizer, group: Any = None) -> None:
        """Balancing "bias"/"bias_per_rank": update every router's bias in an optimizer pre-step hook. "bias"
        sums the loads over `group` (None: all ranks) first; "bias_per_rank" uses this rank's own."""
        if self.config.balancing not in ("bias", "bias_per_rank"):
            return
        def pre_step(opt: Any, args: Any, kwargs: Any) -> None:
            load = self.load.clone()
            if self.config.balancing == "bias" and dist.is_initialized():
                dist.all_reduce(load, group=group)
            self.update_biases(load)
        optimizer.register_step_pre_hook(pre_step)

    @torch.no_grad()
    def update_biases(self, load: torch.Tensor) -> None:
        """bias += gamma * sign(mean load - load), per layer: underloaded experts up, overloaded down."""
        step = self.config.bias_gamma * torch.sign(load.mean(-1, keepdim=True) - load)
        for router, delta in zip(self.routers, step):
            router.e_score_correction_bias += delta.to(router.e_score_correction_bias)
        self.bias_steps += 1

    def fields(self) -> dict[str, Any]:
        """This step's record fields, on this rank: expert_load (per layer, per expert: assignments asked for, all
        micro-batches), maxvio (worst layer), dropped (fraction over capacity), expert_bias (what the routers chose
        with in this step's forward)."""
        asked = float(self.load.sum())
        return {"expert_load": self.load.tolist(), "maxvio": float(max_violation(self.load).max()),
                "dropped": 1.0 - float(self.kept.sum()) / asked if asked else 0.0,
                "expert_bias": self.bias_used.tolist()}

    def fields_after_step(self) -> dict[str, Any]:
        """Read after the optimizer step: bias_after, each router's bias once this rank updated it."""
        if self.config.balancing not in ("bias", "bias_per_rank"):
            return {}
        return {"bias_after": [r.e_score_correction_bias.detach().float().cpu().tolist() for r in self.routers]}
