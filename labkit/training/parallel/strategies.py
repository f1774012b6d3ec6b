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
    """Wrap `model` for config.strategy on this rank and build its optimizer (optim.make_optimizer)."""
    dp, tp = config.parallel_dims
    if config.strategy == "pp":
        from .pipestep import PipelineStep
        step = PipelineStep(model, task, config, ctx)
        more = None
        if config.task == "tinymoe":  # DeepSeek-V3's layout: experts inside each stage's data parallelism
            from .v3_layout import place_v3
            optimizer, more = place_v3(step, task, config, ctx, make_optimizer)
        elif config.pipeline_zero1:
            from .v3_layout import zero1_beside
            optimizer = zero1_beside(config, step.parts, [], step.pipe.dp_group, make_optimizer)
        else:
            optimizer = make_optimizer(config, step.parts.parameters())
        return Placement(step.parts, optimizer, step.task, StateMeter(step.parts, optimizer, COUNTED_STEPS),
                         dispatch_counted=True, owned=step.parts, forward_backward=step, more=more)
    if config.task == "tinymoe" and config.strategy in ("fsdp", "fsdp+tp"):  # the article's (parallel/moe_tp.py)
        return _moe_sharded(model, task, config, ctx, dp, tp)
    if config.task == "tinymoe":  # DDP, and the experts over expert-parallel ranks (parallel/moe_layout.py)
        from .moe_layout import place_experts
        wrapped, optimizer, more = place_experts(model, task, config, ctx, make_optimizer)
        return Placement(wrapped, optimizer, task, StateMeter(model, optimizer, COUNTED_STEPS), dispatch_counted=True,
                         more=more)
    if config.context_parallel > 1:  # sequences split over groups of neighbours, inside DDP (context_model.py)
        from .context_model import place_context
        task, _ = place_context(model, make_task(config, config.world_size // config.context_parallel), config,
                                ctx.rank)
        optimizer = make_optimizer(config, model.parameters())
        return Placement(_ddp(model, config, ctx), optimizer, task, StateMeter(model, optimizer, COUNTED_STEPS),
                         tp=config.context_parallel)
    if config.strategy in ("ddp", "zero1"):
        recompute_blocks(model, config.recompute)   # before DDP: it registers the (wrapped) parameters
        wrapped = _ddp(model, config, ctx)
        if config.strategy == "ddp":
            optimizer = make_optimizer(config, model.parameters())
        else:
            optimizer = _zero1(config, model)
        return Placement(wrapped, optimizer, task, StateMeter(model, optimizer, COUNTED_STEPS),
                         dispatch_counted=config.strategy != "ddp")
    from .fullshard import Sharded, shard_model
    from .tensor_parallel import linear_gpt2, split_blocks
    mesh = _mesh(ctx, dp, tp)
    root = None
    if tp > 1:
        split_blocks(linear_gpt2(model), mesh["tp"] if dp > 1 else mesh, sequence_parallel=config.sequence_parallel)
        task = SharedBatches(make_task(config, dp), tp)
    # after TP rebuilt the blocks, before fully_shard: FSDP2's hooks stay outside the recomputed region
    recompute_blocks(model, config.recompute)
    if config.strategy != "tp":
        root = shard_model(model, mesh["dp"] if tp > 1 else mesh, reshard_after_forward=config.strategy != "zero2")
    optimizer = make_optimizer(config, model.parameters())
    return Placement(Sharded(model, root), optimizer, task, StateMeter(model, optimizer, COUNTED_STEPS), tp=tp,
                     dispatch_counted=True)


def _moe_sharded(model: nn.Module, task: Task, config: RunConfig, ctx: RankContext, dp: int, tp: int) -> Placement:
    """tinymoe under ZeRO-3 (FSDP2 layer by layer), after TP inside each layer on a (dp, tp) mesh for "fsdp+tp"
    (parallel/moe_tp.py); the routers' bias moves with loads summed over the data-parallel ranks (a TP pair routes
    the same tokens: count them once)."""
    from .fullshard import Sharded
    from .moe_tp import decoder_layers, shard_deepseek, split_deepseek
    mesh = _mesh(ctx, dp, tp)
    dp_mesh = mesh["dp"] if tp > 1 else mesh
    if tp > 1:
        split_deepseek(model, mesh["tp"])
    root = shard_deepseek(model, dp_mesh)
    optimizer = make_optimizer(config, model.parameters())
    inner = make_task(config, dp)
    inner.routing = task.routing  # the routers' taps were made when `task` built the model
    task.routing.attach(optimizer, group=dp_mesh.get_group())
    meter = StateMeter(model, optimizer, COUNTED_STEPS, blocks=decoder_layers(model))
    return Placement(Sharded(model, root), optimizer, SharedBatches(inner, tp), meter, tp=tp, dispatch_counted=True,
                     more=task.routing.fields_after_step)


class SharedBatches(Task):
    """A task sliced over the data-parallel ranks only: every rank of a tensor-parallel group gets the batch of
    its data-parallel rank (rank // tp, ranks laid out data-parallel-major as in the mesh)."""

    def __init__(self, inner: Task, tp: int):
        self.inner, self.tp = inner, tp
        self.config, self.world_size, self.batch_size = inner.config, inner.world_size, inner.batch_size
        self.loss_floor, self.tokens_per_sample = inner.loss_floor, inner.tokens_per_sample

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.batch(step, micro, rank // self.tp)

    def loss(self, model: Any, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return self.inner.loss(model, inputs, targets)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return self.inner.evaluate(model)

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()


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


def _mesh(ctx: RankContext, dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    if dp > 1 and tp > 1:
        return init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(ctx.device.type, (dp * tp,))


def _full(value: Any) -> Any:
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value
