"""DeepSeek-V3's layout for tinymoe: pipeline x expert parallelism x ZeRO-1, no tensor parallelism.

    cfg = RunConfig(task="tinymoe", strategy="pp", world_size=4, pipeline_ranks=2, expert_parallel=2,
                    pipeline_zero1=True, pipeline_schedule="1F1B", microbatches=2)
    labkit.launch(cfg)     # strategies.distribute: PipelineStep (the cut, moe_stages.py), then place_v3 (here)

On 4 ranks: 2 stages x 2 data-parallel replicas, rank = replica * 2 + stage (pipeline.py's mesh ("dp", "pp")), so
stage 0 runs on ranks 0 and 2, stage 1 on ranks 1 and 3. What V3's report (arXiv 2412.19437, section 3.2) does at
16 stages x 64-way EP over 8 nodes x ZeRO-1, in miniature:
  - **EP inside DP.** The two ranks of a stage (its data-parallel pair) split that stage's routed experts: with
    expert_parallel = 2, rank 0 owns experts 0-3 of layer 0, rank 2 experts 4-7; tokens travel between them by
    all_to_all over the pair (experts.ExpertParallel). Every other parameter of the stage is replicated on the
    pair. No rank ever exchanges tokens with another stage: EP never crosses the pipeline.
  - **Gradients.** The pipeline averages the replicated parameters over the pair after its step (an all-reduce
    each); the experts' are kept apart (`Pipeline.keep_apart`): the owner's gradient already sums both replicas'
    tokens (all_to_all's backward brought them back), and is divided by the replicas only.
  - **ZeRO-1** (pipeline_zero1): the replicated parameters' optimizer state is sharded over the pair by torch's
    ZeroRedundancyOptimizer (each rank updates the parameters it was assigned, whole tensors, largest first, then
    broadcasts them); an expert's state stays with its owner, the only rank that holds the expert.
    `ZeroBeside` steps both as one optimizer for labkit's loop.
  - **Balancing.** Routing counts of a stage's layers exist on that stage's ranks only: the bias update sums them
    over the stage's data-parallel pair (`Routing.attach(group=...)`), the tokens that went through those layers.
    (Summed over all ranks the other stage would add zeros: the same numbers for one more collective that ties
    every stage to every other at each optimizer step.)
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .experts import expert_parallel_modules
from .moe_layout import split_experts_over
from ...config import RunConfig
from ...context import RankContext


class ZeroBeside(torch.optim.Optimizer):
    """ZeroRedundancyOptimizer for the parameters a data-parallel group shares, beside a plain optimizer for the
    parameters only this rank holds (its experts), stepped as one optimizer:  ZeroBeside(zero, own)."""

    def __init__(self, zero: Any, own: torch.optim.Optimizer):
        self.zero, self.own = zero, own
        groups = [{**g, "params": list(g["params"])} for g in zero.param_groups + own.param_groups]
        super().__init__(groups, dict(own.defaults))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        # the loop sets the LR on this optimizer's groups: hand it (and any other setting) to the two inside
        for mine, theirs in zip(self.param_groups, self.zero.param_groups + self.own.param_groups):
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        self.zero.step()
        self.own.step()
        self.state = {**self.zero.optim.state, **self.own.state}  # what held.py counts: this rank's state


def place_v3(step: Any, task: Any, config: RunConfig, ctx: RankContext,
             make_optimizer: Callable[[Any, Any], torch.optim.Optimizer]) -> tuple[torch.optim.Optimizer, Callable]:
    """Experts of this rank's stages over their data-parallel pair, the optimizer (ZeRO-1 with pipeline_zero1), the
    bias update over the pair; returns (optimizer, record fields to read after each step)."""
    pipe = step.pipe
    step.task.routing = task.routing  # the routing taps were made when `task` built the model; counts per step
    experts: list[nn.Parameter] = []
    if config.expert_parallel > 1:
        split_experts_over(pipe.parts, pipe.dp_group)
        experts = [p for m in expert_parallel_modules(pipe.parts) for p in m.parameters()]
        pipe.keep_apart(experts)  # EP over the whole pair: no other rank holds copies of these experts
    for stage in pipe.stages:
        uncounted_inference(stage, task.routing, expert_parallel_modules(pipe.parts))
    if config.pipeline_zero1:
        optimizer = zero1_beside(config, pipe.parts, experts, pipe.dp_group, make_optimizer)
    else:
        optimizer = make_optimizer(config, pipe.parts.parameters())
    task.routing.attach(optimizer, group=pipe.dp_group)

    def more() -> dict[str, Any]:
        fields = {**task.routing.fields(), **task.routing.fields_after_step()}  # the loss's extras never run here
        stats = [m.take_stats() for m in expert_parallel_modules(pipe.parts)]
        if stats:
            fields.update({f"ep_{key}": sum(s[key] for s in stats) for key in stats[0]})
        return fields
    return optimizer, more


def uncounted_inference(stage: Any, routing: Any, modules: list[nn.Module]) -> None:
    """Leave the routing counts and the experts' traffic statistics as they were across `stage`'s shape inference.

    With pipeline_shapes "inferred" torch runs each stage's forward once more on the first step to learn the
    shapes it sends (stage.py, _forward_metadata_inference), on the real first microbatch at stage 0 and on
    uninitialised tensors of the right shape after it: the routers' taps would count those tokens as routed (and
    the bias would balance for them); measured, they made one process's and the pipeline's biases differ."""
    infer = stage._forward_metadata_inference

    def forward_metadata_inference(*args: Any, **kwargs: Any) -> Any:
        load, kept, stats = routing.load.clone(), routing.kept.clone(), [dict(m.stats) for m in modules]
        try:
            return infer(*args, **kwargs)
        finally:
            routing.load.copy_(load)
            routing.kept.copy_(kept)
            for module, before in zip(modules, stats):
                module.stats = before
    stage._forward_metadata_inference = forward_metadata_inference


def zero1_beside(config: RunConfig, parts: nn.Module, own: list[nn.Parameter], group: Any,
                 make_optimizer: Callable[[Any, Any], torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer over `group` for parts' parameters except `own`, with a plain optimizer for `own`
    beside it (ZeroBeside); the ZeRO one alone when `own` is empty."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    mine = {id(p) for p in own}
    shared = [p for p in parts.parameters() if id(p) not in mine]
    template = make_optimizer(config, [nn.Parameter(torch.zeros(1))])  # which class, which settings
    settings = {k: v for k, v in template.defaults.items() if k in ("lr", "weight_decay", "momentum")}
    zero = ZeroRedundancyOptimizer(shared, optimizer_class=type(template), process_group=group, **settings)
    return ZeroBeside(zero, make_optimizer(config, own)) if own else zero
