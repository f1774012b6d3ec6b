"""How the model is spread over the ranks (RunConfig.strategy): wrap it, build the optimizer, say what to count.

    placed = distribute(model, task, config, ctx)   # once, in labkit's loop (loop.py)
    loss, _ = placed.task.loss(placed.model, *placed.task.batch(step, 0, ctx.rank))
    placed.optimizer.step()
    placed.fields()          # record fields: bytes of model state this rank holds, collectives by kind

    strategy   what each rank holds                                     built from
    ddp        everything (ZeRO stage 0)                                DistributedDataParallel + comm hook
    zero1      params and grads; 1/N of the optimizer state             DDP + ZeroRedundancyOptimizer
    zero2      1/N of grads and optimizer state; params: 1/N between    FSDP2 fully_shard(reshard_after_forward=
               steps, all of them from forward to the end of backward     False)              (fullshard.py)
    fsdp       1/N of everything (ZeRO stage 3)                         FSDP2 fully_shard      (fullshard.py)
    tp         1/T of each block's matrices, all of the rest            DTensor parallelize_module
                                                                        (tensor_parallel.py)
    fsdp+tp    a 2-D mesh: N/2 data-parallel x 2 tensor-parallel        both of the above (tinymoe: moe_tp.py)
    pp         its stages' blocks (and gradients, optimizer state)      torch.distributed.pipelining
               a 2-D mesh with data-parallel replicas                     (parallel/pipestep.py); tinymoe:
               (pipeline_zero1: 1/dp of the optimizer state; experts     + experts over each stage's data-
               split over each stage's data-parallel ranks)               parallel ranks (v3_layout.py)

Composed (RunConfig.tensor_parallel, context_parallel; config.parallel_dims): the dims are applied in ORDER_OF_WORK,
pipeline stages, TP, CP, then "ddp" (DDP over dp x cp; over a TP model FSDP2's replicate, which keeps the DTensor
parameters) or "fsdp" (FSDP2 over dp x cp flattened), every group from one mesh (mesh.py).

Tensor-parallel ranks of one group compute on the same samples: they read one batch (the batch of their
data-parallel rank) and each is credited with its share of it in the records (`credit`), so that throughput
summed over ranks counts every sample once.

Collectives: "ddp" counts them as before, by wrapping torch.distributed's Python functions (commhooks.py). The
other strategies issue collectives those wrappers never see (FSDP2 calls dist.all_gather_single, DTensor calls
functional collectives), so they are counted at the dispatcher (dispatchcount.py). That costs a few
microseconds per op on every op, which would slow the very steps being timed: only the first COUNTED_STEPS steps
are counted (the pattern repeats every step: the last counted one is the steady state, after DDP's bucket rebuild
on step 1); later records leave allreduces and comm_bytes empty. The bytes held (held.py) are measured on the same
steps, for every strategy: measuring costs about 1 ms a step, and the bytes do not change after the first step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..commhooks import count_collectives, install_comm_hook, single_bucket_mb
from .dispatchcount import DispatchCounter
from .mesh import Mesh
from .shared import SharedBatches
from .held import StateMeter
from .recompute import recompute_blocks
from ..optim import make_optimizer
from ..tasks import Task, make_task
from ...config import RunConfig
from ...context import RankContext

COUNTED_STEPS = 3  # instrumented steps: bytes held (all strategies), collectives at the dispatcher (all but ddp)


@dataclass
class Placement:
    """The distributed model and what goes with it (see the module docstring)."""

    model: Any
    """What the loop calls for forward; has no_sync() for gradient accumulation."""
    optimizer: torch.optim.Optimizer
    task: Task
    meter: StateMeter
    tp: int = 1
    """Ranks that share each batch (the tensor-parallel degree; the context-parallel one)."""
    dispatch_counted: bool = False
    more: Callable[[], dict[str, Any]] | None = None
    """Further record fields, read after each optimizer step (tinymoe: biases, expert-parallel traffic)."""
    owned: nn.Module | None = None
    """The part of the model this rank trains, where it is not all of it (a pipeline's stages)."""
    forward_backward: Callable[..., tuple] | None = None
    """A strategy's own step, in place of the loop's (a pipeline schedules its microbatches itself)."""
    _counter: Any = field(default=None, repr=False)

    def counter(self) -> Any:
        """A context manager whose take() gives (collectives, bytes) per step (None, None when not counted)."""
        self._counter = FirstStepsCounter() if self.dispatch_counted else count_collectives()
        return self._counter

    def credit(self, samples: int) -> int:
        """Samples credited to this rank, from the rows it ran: its share when tensor-parallel ranks share them."""
        return samples // self.tp

    def fields(self) -> dict[str, Any]:
        """Record fields: bytes held (held.py) and, on counted steps, collectives by kind: n_all_gather (calls),
        bytes_all_gather (bytes handed to them), ..."""
        kinds = getattr(self._counter, "last_kinds", {})
        by_kind = {f"{prefix}_{kind}": value for kind, pair in kinds.items()
                   for prefix, value in zip(("n", "bytes"), pair)}
        return {**self.meter.fields(), **by_kind, **(self.more() if self.more else {})}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole parameters, gathered from shards where needed (a collective: call it on every rank)."""
        # On a 2-D mesh DTensor warns that it gathers in two steps (a speed remark about this one-off gather)
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            return {name: _full(value) for name, value in model.state_dict().items()}
        finally:
            quiet.setLevel(level)


class FirstStepsCounter:
    """A DispatchCounter switched on for the first COUNTED_STEPS steps only; take() closes each step."""

    def __init__(self, steps: int = COUNTED_STEPS):
        self.steps_left = steps
        self.mode = DispatchCounter()
        self.last_kinds: dict[str, tuple[int, int]] = {}
        self._active = False

    def __enter__(self) -> "FirstStepsCounter":
        if self.steps_left > 0:
            self.mode.__enter__()
            self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()

    def take(self) -> tuple[int | None, int | None]:
        if not self._active:
            self.last_kinds = {}
            return None, None
        calls, sent = self.mode.take()
        self.last_kinds = self.mode.take_kinds()
        self.steps_left -= 1
        if self.steps_left <= 0:
            self._stop()
        return calls, sent

    def _stop(self) -> None:
        if self._active:
            self.mode.__exit__(None, None, None)
            self._active = False


def distribute(model: nn.Module, task: Task, config: RunConfig, ctx: RankContext) -> Placement:
    """Spread `model` over the ranks as config.parallel_dims asks, in ORDER_OF_WORK, and build its optimizer
    (optim.make_optimizer). tinymoe's layouts are named plans (PLANS)."""
    dims = config.parallel_dims
    mesh = Mesh.of(dims, ctx.device)   # every group below comes from it, built in the same order on every rank
    if config.task == "tinymoe":
        return PLANS[moe_plan(config)](model, task, config, ctx, mesh)
    step = None
    if dims.pp > 1:                                            # 1. cut the model into this rank's stages
        from .pipestep import PipelineStep
        step = PipelineStep(model, task, config, ctx)
    if dims.tp > 1:                                            # 2. split the blocks they hold
        from .tensor_parallel import linear_gpt2, split_blocks
        for held in (step.parts if step else [model]):
            split_blocks(linear_gpt2(held), mesh.sub("tp"), sequence_parallel=config.sequence_parallel)
    if step is not None:                                       # (a pipeline averages its replicas itself)
        return _pipeline(step, config, dims)
    shared = SharedBatches(make_task(config, dims.dp), dims, ctx.rank) if dims.tp > 1 else task
    if dims.cp > 1:                                            # 3. split the sequences' attention
        from .context_model import place_context
        shared, _ = place_context(model, make_task(config, dims.dp), config, mesh)
    # 4. recomputation: after TP rebuilt the blocks, before DDP registers them and FSDP2 hooks outside them
    recompute_blocks(model, config.recompute)
    wrapped, optimizer = _data_parallel(model, config, ctx, mesh)   # 5. what is left: DDP or FSDP2 over dp x cp
    return Placement(wrapped, optimizer, shared, StateMeter(model, optimizer, COUNTED_STEPS), tp=dims.tp * dims.cp,
                     dispatch_counted=config.strategy != "ddp" or dims.tp > 1)


ORDER_OF_WORK = ("pp", "tp", "cp", "dp")
"""The order distribute applies the parallelisms in (torchtitan's): the pipeline cuts whole blocks, so it goes first
and each rank splits only the blocks it holds; TP rebuilds each block's layers (nn.Linear, then DTensor shards), so
it must precede anything that registers those layers' parameters; CP swaps the attention function inside the
already-split blocks (each rank attends with its own heads over its own positions); data parallelism wraps last,
because DDP registers and FSDP2 shards the parameters as they are then, TP's DTensors included (sharding first and
splitting after would split FSDP2's shards, not the matrices)."""


def _data_parallel(model: nn.Module, config: RunConfig, ctx: RankContext, mesh: Mesh) -> tuple[Any, Any]:
    """The data-parallel ranks' wrapper over dp x cp (context-parallel ranks hold the same model and their
    gradients are averaged with the data-parallel ones) and the optimizer."""
    from .fullshard import Sharded, shard_model   # FSDP2's import, paid only where it is used
    dims = mesh.dims
    if config.strategy in ("ddp", "zero1"):
        if dims.tp == 1:   # dp x cp is the whole world: the default group, as DDP always had
            wrapped = _ddp(model, config, ctx)
        elif dims.dp * dims.cp == 1:
            wrapped = Sharded(model, None)
        else:   # replicated over a tensor-parallel model: FSDP2's replicate (DDP's data parallelism, its
            # gradients all-reduced) keeps TP's DTensor parameters as they are; DDP(device_mesh=...) unregisters them
            # after the first forward (torch's "temporary workaround"): state dicts, grad norms and held bytes lost
            from torch.distributed._composable.replicate_with_fsdp import replicate
            wrapped = Sharded(model, replicate(model, mesh=mesh.sub("dp", "cp")))
        optimizer = make_optimizer(config, model.parameters()) if config.strategy == "ddp" else _zero1(config, model)
        return wrapped, optimizer
    root = None
    if config.strategy != "tp" and dims.dp * dims.cp > 1:
        root = shard_model(model, mesh.sub("dp", "cp"), reshard_after_forward=config.strategy != "zero2")
    return Sharded(model, root), make_optimizer(config, model.parameters())


def _pipeline(step: Any, config: RunConfig, dims: Any) -> Placement:
    """A pipeline's stages (pipestep.py) with their optimizer: ZeRO-1 over each stage's replicas, or plain."""
    if config.pipeline_zero1:
        from .v3_layout import zero1_beside
        optimizer = zero1_beside(config, step.parts, [], step.pipe.dp_group, make_optimizer)
    else:
        optimizer = make_optimizer(config, step.parts.parameters())
    return Placement(step.parts, optimizer, step.task, StateMeter(step.parts, optimizer, COUNTED_STEPS), tp=dims.tp,
                     dispatch_counted=True, owned=step.parts, forward_backward=step)


def moe_plan(config: RunConfig) -> str:
    """Which of PLANS places tinymoe for this config."""
    return {"pp": "v3", "fsdp": "zero3", "fsdp+tp": "zero3"}.get(config.strategy, "ddp+ep")


def _v3(model: nn.Module, task: Task, config: RunConfig, ctx: RankContext, mesh: Mesh) -> Placement:
    from .pipestep import PipelineStep
    from .v3_layout import place_v3
    step = PipelineStep(model, task, config, ctx)
    optimizer, more = place_v3(step, task, config, ctx, make_optimizer)
    return Placement(step.parts, optimizer, step.task, StateMeter(step.parts, optimizer, COUNTED_STEPS),
                     dispatch_counted=True, owned=step.parts, forward_backward=step, more=more)


def _ddp_ep(model: nn.Module, task: Task, config: RunConfig, ctx: RankContext, mesh: Mesh) -> Placement:
    from .moe_layout import place_experts
    wrapped, optimizer, more = place_experts(model, task, config, ctx, mesh, make_optimizer)
    return Placement(wrapped, optimizer, task, StateMeter(model, optimizer, COUNTED_STEPS), dispatch_counted=True,
                     more=more)


def _moe_sharded(model: nn.Module, task: Task, config: RunConfig, ctx: RankContext, mesh: Mesh) -> Placement:
    """tinymoe under ZeRO-3 (FSDP2 layer by layer), after TP inside each layer on a (dp, tp) mesh for "fsdp+tp"
    (parallel/moe_tp.py); the routers' bias moves with loads summed over the data-parallel ranks (a TP pair routes
    the same tokens: count them once)."""
    from .fullshard import Sharded
    from .moe_tp import decoder_layers, shard_deepseek, split_deepseek
    dims = mesh.dims
    dp_mesh = mesh.sub("dp")
    if dims.tp > 1:
        split_deepseek(model, mesh.sub("tp"))
    root = shard_deepseek(model, dp_mesh)
    optimizer = make_optimizer(config, model.parameters())
    inner = make_task(config, dims.dp)
    inner.routing = task.routing  # the routers' taps were made when `task` built the model
    task.routing.attach(optimizer, group=dp_mesh.get_group())
    meter = StateMeter(model, optimizer, COUNTED_STEPS, blocks=decoder_layers(model))
    return Placement(Sharded(model, root), optimizer, SharedBatches(inner, dims, ctx.rank), meter, tp=dims.tp,
                     dispatch_counted=True, more=task.routing.fields_after_step)


PLANS: dict[str, Callable[..., Placement]] = {"v3": _v3, "ddp+ep": _ddp_ep, "zero3": _moe_sharded}
"""tinymoe's layouts, by name: "v3" DeepSeek-V3's PP x EP x ZeRO-1 (v3_layout.py), "ddp+ep" DDP with the experts
split over expert-parallel ranks carved out of the data-parallel ones (moe_layout.py), "zero3" the article's FSDP2
layer by layer, with TP inside each layer under "fsdp+tp" (moe_tp.py)."""


def bucket_cap_mb(config: RunConfig, model: nn.Module, ctx: RankContext) -> float:
    """config.bucket_cap_mb, raised to one bucket for PowerSGD on gloo (which aborts with several)."""
    if config.comm_hook == "powersgd" and ctx.backend == "gloo":
        size = single_bucket_mb(model)
        if config.bucket_cap_mb < size:
            print(f"labkit: PowerSGD on gloo needs one DDP bucket; bucket_cap_mb {config.bucket_cap_mb} -> {size:.1f}")
            return size
    return config.bucket_cap_mb


def _ddp(model: nn.Module, config: RunConfig, ctx: RankContext) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
              bucket_cap_mb=bucket_cap_mb(config, model, ctx))
    install_comm_hook(ddp, config.comm_hook, powersgd_rank=config.powersgd_rank)
    return ddp


def _zero1(config: RunConfig, model: nn.Module) -> Any:
    """ZeroRedundancyOptimizer over the optimizer make_optimizer builds (same class, same settings)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    # make_optimizer knows which class and settings config asks for; a throwaway instance tells us both
    template = make_optimizer(config, [nn.Parameter(torch.zeros(1))])
    settings = {k: v for k, v in template.defaults.items() if k in ("lr", "weight_decay", "momentum")}
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(template), **settings)


def _full(value: Any) -> Any:
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value
