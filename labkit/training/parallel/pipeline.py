"""Pipeline parallelism (RunConfig.strategy = "pp") on torch.distributed.pipelining, for tinylm's GPT-2 and
tinymoe's DeepSeek-V3 (cut by moe_stages.py; its experts placed by v3_layout.py).

    cfg = RunConfig(strategy="pp", world_size=2, layers=4, microbatches=4, pipeline_schedule="1F1B")
    labkit.launch(cfg)        # the loop calls place_pipeline (strategies.distribute) and then Pipeline.run per step

    pipe = build_pipeline(model, config, rank=r, world_size=w)      # inside a rank, for lessons and tests
    loss = pipe.run(inputs, targets)       # one step: every microbatch forward and backward; the loss on the last stage
    pipe.trace.take()                      # what each stage of this rank computed, timed (pipetrace.py)

**The cut.** The model's blocks are divided evenly over p*v stages (p ranks in a pipeline, v = stages_per_rank):
stage 0 also holds the embeddings, the last stage the final LayerNorm and the LM head (`split_gpt2`). GPT-2 ties
its head to the token embedding: the two ends of the pipeline hold one matrix, and each computes only part of
its gradient. As in Megatron-LM, the two parts are summed between the ranks of the first and the last stage
after backward (one all-reduce of the embedding's gradient), so both copies take the same optimizer step and stay
equal; where one rank holds both ends (the V-shaped schedules), the two share the Parameter itself. DeepSeek-V3
does not tie them (`tied_weight` is None): nothing to sum.

**Where stages sit.** GPipe and 1F1B run one stage per rank; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble
loop v stages over the ranks (stage s on rank s mod p); ZBVZeroBubble and DualPipeV put two stages per rank in a V
(rank 0 holds the first and the last). With data parallelism too (world_size = dp x p), the ranks form a 2-D mesh
("dp", "pp"): rank = replica * p + position, each replica reads its own rows, and after the pipeline's step every
gradient is averaged over the replicas holding the same stage, except the parameters `keep_apart` names (experts
split over the replicas: each rank's are its own, and their gradients already hold every replica's tokens).

**Shapes between stages** (RunConfig.pipeline_shapes): "inferred" lets torch find them on the first step, sending
each stage's output metadata as a pickled object (`send_object_list`/`recv_object_list`, which go through
`tensor.numpy()`: that is why numpy is required; without it the receiving rank fails with "Numpy is not available"
and its peer only sees "Connection closed by peer"). "fixed" passes example tensors (inputs, outputs and their
gradients) to every stage. "fixed_no_grad" is the trap: the same, but a later stage's example input lacks
requires_grad, so that stage never computes the gradient it owes the stage before it; nothing raises, and the
earlier stages train on wrong gradients. RunConfig.pipeline_check (on by default) catches it on the first step:
`check_against_unsplit` runs the whole model on the whole batch and compares every gradient this rank holds.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .moe_stages import is_deepseek, split_deepseek
from .pipetrace import StageTrace
from ...config import RunConfig
from ...dims import ParallelDims
from .held import local   # a DTensor's shard: what a process-group collective takes
from .mesh import Mesh

SINGLE = ("GPipe", "1F1B")                                       # one stage per rank
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")  # v stages per rank, stage s on rank s mod p
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")                        # two stages per rank, in a V
SCHEDULES = SINGLE + LOOPED + V_SHAPED
CHECK_RTOL = 1e-4
"""pipeline_check: the largest gradient error allowed, relative to the largest gradient of the parameter. The
pipeline averages m microbatch means where one process takes one mean: they agree to float32 rounding (about 1e-6
relative, measured); the trap's errors are percents."""


class PipelineGradientError(RuntimeError):
    """The pipelined gradients differ from the unsplit model's on the same batch (RunConfig.pipeline_check)."""


class GPT2Stage(nn.Module):
    """Some consecutive blocks of a transformers GPT-2, with the embeddings if first and the head if last."""

    def __init__(self, model: nn.Module, blocks: range, *, first: bool, last: bool):
        super().__init__()
        t = model.transformer
        self.first, self.last, self.blocks = first, last, blocks
        self.wte, self.wpe, self.drop = (t.wte, t.wpe, t.drop) if first else (None, None, None)
        self.h = nn.ModuleList(t.h[i] for i in blocks)
        self.ln_f, self.lm_head = (t.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.h:
            x = block(x)  # no mask: GPT-2's attention is then causal (transformers' sdpa path)
            x = x[0] if isinstance(x, tuple) else x
        return self.lm_head(self.ln_f(x)) if self.last else x


def split_gpt2(model: nn.Module, stages: int) -> list[GPT2Stage]:
    """Cut a GPT-2 into `stages` stages of equal numbers of blocks:  split_gpt2(model, 4)[0].h -> its first block."""
    n = len(model.transformer.h)
    if n % stages:
        raise ValueError(f"{n} blocks do not split evenly into {stages} stages; use RunConfig.layers = a multiple "
                         f"of {stages}")
    per = n // stages
    return [GPT2Stage(model, range(s * per, (s + 1) * per), first=s == 0, last=s == stages - 1)
            for s in range(stages)]


def split_model(model: nn.Module, stages: int) -> list[nn.Module]:
    """GPT-2 (split_gpt2) or DeepSeek-V3 (moe_stages.split_deepseek) cut into `stages` stages."""
    return split_deepseek(model, stages) if is_deepseek(model) else split_gpt2(model, stages)


def tied_weight(model: nn.Module) -> nn.Parameter | None:
    """The weight the input embedding and the LM head share (GPT-2), or None when they are apart (DeepSeek-V3)."""
    weight = model.get_input_embeddings().weight
    return weight if weight is model.get_output_embeddings().weight else None


def stage_ranks(schedule: str, ranks: int, per_rank: int) -> dict[int, int]:
    """{stage: position in the pipeline} for a schedule:  stage_ranks("DualPipeV", 2, 2) -> {0: 0, 1: 1, 2: 1, 3: 0}."""
    stages = ranks * per_rank
    if schedule not in V_SHAPED:
        return {s: s % ranks for s in range(stages)}
    return {s: (s % ranks if (s // ranks) % 2 == 0 else ranks - 1 - s % ranks) for s in range(stages)}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """tinylm's loss (TinyLM.loss), on the last stage's output."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class Pipeline:
    """This rank's stages of one pipeline and the schedule that runs them (see the module docstring)."""

    def __init__(self, model: nn.Module, config: RunConfig, *, rank: int, world_size: int, device: torch.device,
                 microbatches: int | None = None):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class
        self.config, self.model = config, model
        dims = config.parallel_dims if world_size == config.world_size else \
            ParallelDims.fit(world_size, pp=config.pipeline_ranks or world_size)
        self.mesh = Mesh.of(dims, device)
        p, at = dims.pp, dims.coords(rank)
        self.ranks, self.replicas = p, dims.dp
        self.replica, self.position = at["dp"], at["pp"]
        self.group = self.mesh.group("pp")
        self.dp_group = self.mesh.group("dp")
        self.m = microbatches or config.microbatches
        v, name = config.stages_per_rank, config.pipeline_schedule
        self.where = stage_ranks(name, p, v)
        parts = split_model(model, p * v)
        self.indices = [s for s in range(p * v) if self.where[s] == self.position]
        self.parts = nn.ModuleList(parts[s] for s in self.indices)
        self.trace = StageTrace()
        self.stages = []
        for s in self.indices:
            shapes = example_shapes(config, s, p * v, self.m, self.replicas, device, model.config.hidden_size) \
                if config.pipeline_shapes != "inferred" else {}
            stage = PipelineStage(parts[s], s, p * v, device, group=self.group, **shapes)
            self.trace.watch(stage)
            self.stages.append(stage)
        cls = get_schedule_class(name)
        self.schedule = cls(self.stages[0] if name in SINGLE else self.stages, n_microbatches=self.m,
                            loss_fn=lm_loss, scale_grads=False)  # scaled once per parameter in sync_gradients
        self.tied = tied_weight(model)
        self.tie = _tie_group(self, rank) if self.tied is not None else None
        self.apart: list[nn.Parameter] = []
        self.apart_group: Any = None

    def keep_apart(self, params: list[nn.Parameter], group: Any = None) -> None:
        """Parameters not averaged over the replicas (experts split over them): their gradients are summed over
        `group` (the ranks holding copies of the same experts; None: no copies) and divided by the replicas."""
        self.apart, self.apart_group = list(params), group

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.config_stages - 1 in self.indices

    @property
    def config_stages(self) -> int:
        return self.ranks * self.config.stages_per_rank

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One step of the schedule on this replica's batch, then the tied embedding's and the replicas' gradient
        sums. Returns the mean loss over the microbatches on the rank of the last stage, None elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        self.sync_gradients()
        return torch.stack(losses).mean().item() if self.has_last else None

    def sync_gradients(self) -> None:
        """Average over the microbatches, sum the tied embedding's two halves, average over the replicas.

        The schedule is told not to scale (scale_grads=False): torch scales each stage's parameters, and a V puts
        the tied embedding in two stages of one rank, which scaled it twice (a wrong gradient, measured)."""
        for param in self.parts.parameters():  # each Parameter once, even when two stages share it
            if param.grad is not None:
                param.grad /= self.m
        if self.tie is not None:
            dist.all_reduce(local(self.tied.grad), group=self.tie)
        apart = {id(p) for p in self.apart}
        for param in self.parts.parameters():
            if param.grad is None or self.replicas == 1:
                continue
            group = self.apart_group if id(param) in apart else self.dp_group
            if group is not None:   # a tensor-parallel shard's gradient is a DTensor: its local part is summed
                dist.all_reduce(local(param.grad), group=group)
            param.grad /= self.replicas


def example_shapes(config: RunConfig, stage: int, stages: int, m: int, replicas: int, device: torch.device,
                   width: int) -> dict:
    """PipelineStage's fixed-shape arguments for one stage of a model `width` wide (RunConfig.pipeline_shapes
    "fixed"); under "fixed_no_grad" a later stage's example input lacks requires_grad (the trap: see the module
    docstring)."""
    rows = config.global_batch // (replicas * m)
    hidden = torch.zeros(rows, config.seq_len, width, device=device)
    logits = torch.zeros(rows, config.seq_len, config.vocab_size, device=device)
    if stage == 0:
        inputs = torch.zeros(rows, config.seq_len, dtype=torch.long, device=device)
    else:
        inputs = hidden.clone().requires_grad_(config.pipeline_shapes == "fixed")
    output = logits if stage == stages - 1 else hidden
    return {"input_args": (inputs,), "output_args": (output,), "output_grads": (output.clone(),),
            "input_grads": (None,) if stage == 0 else (hidden.clone(),)}


def check_against_unsplit(pipe: Pipeline, reference: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                          rtol: float = CHECK_RTOL) -> dict[str, float]:
    """Compare the gradients this rank holds with those of `reference` (the whole model, as it was before the step)
    on the whole global batch; raise PipelineGradientError naming the stage and the parameter when they differ.
    Returns {parameter: error relative to its largest gradient}."""
    reference.zero_grad(set_to_none=True)
    lm_loss(reference(input_ids=inputs).logits, targets).backward()
    wanted = dict(reference.named_parameters())
    # A gradient that is zero in exact arithmetic (attention's key bias: softmax ignores what it adds to every score)
    # is rounding noise on both sides; it is judged against a thousandth of the model's largest gradient instead.
    floor = 1e-3 * max(p.grad.abs().max().item() for p in wanted.values() if p.grad is not None)
    errors, worst = {}, None
    for name, param in pipe.model.named_parameters():
        owner = _owning_stage(pipe, param)
        if owner is None or (param is pipe.tied and not pipe.has_first):
            continue  # the tied embedding is judged where stage 0 is: its sum names stage 0's part too
        want = wanted[name].grad if name in wanted else expert_slice(pipe.model, name, wanted)
        got = _full(param.grad) if param.grad is not None else torch.zeros_like(want)
        errors[name] = ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()
        if errors[name] > rtol and (worst is None or errors[name] > errors[worst[0]]):
            worst = (name, owner)
    if worst:
        name, owner = worst
        raise PipelineGradientError(
            f"stage {owner} (rank {dist.get_rank()}): the gradient of {name} differs from the unsplit model's on "
            f"the same batch by {errors[name]:.3g} of its largest value (allowed {rtol:g}) at the first step. Most "
            "likely a stage received no gradient for its output: with pipeline_shapes 'fixed', every later stage's "
            "example input needs requires_grad=True; 'inferred' finds the shapes itself")
    return errors


def expert_slice(model: nn.Module, name: str, wanted: dict[str, nn.Parameter]) -> torch.Tensor:
    """The reference gradient of an expert split out of transformers' fused experts (experts.ExpertBank):
    "...mlp.experts.bank.experts.1.down_proj" is row first + 1 of the fused "...mlp.experts.down_proj"."""
    prefix, _, rest = name.partition(".bank.experts.")
    index, kind = rest.split(".")
    first = model.get_submodule(prefix + ".bank").first
    return wanted[f"{prefix}.{kind}"].grad[first + int(index)]


def _owning_stage(pipe: Pipeline, param: nn.Parameter) -> int | None:
    for s, part in zip(pipe.indices, pipe.parts):
        if any(param is p for p in part.parameters()):
            return s
    return None


def _tie_group(pipe: Pipeline, rank: int) -> Any:
    """The group of this rank's first- and last-stage ranks (same replica, same tensor-parallel coordinate), when
    they differ; None where one rank holds both ends, or this rank holds neither. The mesh builds every such group
    on every rank, in one order, as torch requires."""
    first, last = pipe.where[0], pipe.where[pipe.config_stages - 1]
    if first == last or pipe.position not in (first, last):
        return None if first == last else pipe.mesh.groups_of(_ends(pipe, first, last))
    if pipe.ranks == 2:
        return pipe.group   # the pipeline's own group is exactly the two ends
    return pipe.mesh.groups_of(_ends(pipe, first, last))


def _ends(pipe: Pipeline, first: int, last: int) -> list[list[int]]:
    return [[ranks[first], ranks[last]] for ranks in pipe.mesh.dims.groups("pp")]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh); the tensor itself otherwise."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def reference_copy(model: nn.Module) -> nn.Module:
    """A copy of the whole model before training changes it, without its forward hooks (tinymoe's routing taps
    count tokens for the records; the check's extra forward must not): what pipeline_check compares against."""
    reference = copy.deepcopy(model)
    for module in reference.modules():
        module._forward_hooks.clear()
    return reference
