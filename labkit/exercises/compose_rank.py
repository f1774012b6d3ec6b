"""Inside each rank of lesson 25's checker: the learner's mesh, batch and parallelize, against one process.

    out = drive_compose(ctx, build_mesh=..., which_batch=..., parallelize=..., dims=dict(dp=2, tp=2))

Each piece is judged with labkit's reference standing in for the others (the checker passes the reference in
place of a piece that failed its own check), so that one mistake is blamed on the function that made it.
The reference solution is here too (REFERENCE_* below; checks_compose.COMPOSE_REFERENCE bundles them).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import RunConfig
from ..dims import ParallelDims
from ..training.parallel import context as cp
from ..tricks import compose
from .learner import learner_part

DIMS = ("dp", "cp", "tp")
"""The capstone's mesh dimensions, outermost first (labkit's ORDER without the pipeline)."""
BATCH, SEQ, LAYERS = 8, 16, 2


def checker_config(dims: ParallelDims) -> RunConfig:
    return RunConfig(task="tinylm", world_size=dims.world, global_batch=BATCH, seq_len=SEQ, layers=LAYERS,
                     save_final=False, tensorboard=False)


def reference_build_mesh(dims: Any) -> Any:
    """The mesh over ("dp", "cp", "tp"), outermost first: tp innermost, as which_batch's arithmetic assumes."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dims.dp, dims.cp, dims.tp), mesh_dim_names=DIMS)


def reference_which_batch(rank: int, dims: Any) -> tuple[int, int]:
    """(data shard, sequence part) of `rank`: rank = (d * cp + c) * tp + t, so tp ranks share both."""
    return rank // (dims.cp * dims.tp), rank // dims.tp % dims.cp


def reference_parallelize(model: Any, dims: Any, mesh: Any) -> Any:
    """TP inside each block, then CP attention, then FSDP2 over dp x cp (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    for block in model.transformer.h:
        parallelize_module(block, mesh["tp"], compose.block_plan())
        compose.local_heads(block, dims.tp)
    compose.context_attention(model, mesh["cp"].get_group())
    fully_shard(model, mesh=compose.flat(mesh, "dp", "cp"))
    return model


SHARDED_FIRST = ("sharding before TP: fully_shard ran before parallelize_module, so TP would split FSDP2's shards, "
                 "not the matrices; apply TP first, then CP, then fully_shard")


class ShardedFirst(RuntimeError):
    """The learner's parallelize sharded with FSDP2 before TP split the blocks (and torch refused)."""


def shard_first(calls: list[str]) -> bool:
    """Whether fully_shard was called before parallelize_module in `calls` (the spy's record)."""
    return "fully_shard" in calls and "parallelize_module" in calls and \
        calls.index("fully_shard") < calls.index("parallelize_module")


class _Spy:
    """Replace torch's fully_shard and parallelize_module in the learner's globals by wrappers that note the order
    they were called in (restored on exit)."""

    def __init__(self, func: Any):
        self.glob = getattr(func, "__globals__", {})
        self.calls: list[str] = []
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> "_Spy":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
        watched = {id(fully_shard): "fully_shard", id(parallelize_module): "parallelize_module"}
        for name, value in list(self.glob.items()):
            if id(value) in watched:
                self.saved[name] = value
                self.glob[name] = self._wrap(value, watched[id(value)])
        return self

    def _wrap(self, func: Any, label: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(label)
            return func(*args, **kwargs)
        return wrapper

    def __exit__(self, *exc: Any) -> None:
        self.glob.update(self.saved)


def _ranks(mesh: Any, name: str) -> list[int] | None:
    try:
        return sorted(dist.get_process_group_ranks(mesh[name].get_group()))
    except Exception:   # the learner's mesh lacks the dimension, or is not a mesh
        return None


def drive_compose(ctx: Any, build_mesh: Any, which_batch: Any, parallelize: Any, dims: dict) -> dict[str, Any]:
    """One forward and backward of the learner's layout on this rank's share of one batch, against one process on
    the whole batch (see the module docstring)."""
    dims_ = ParallelDims(**dims)
    config = checker_config(dims_)
    out: dict[str, Any] = {"rank": ctx.rank}
    with learner_part(ctx, "build_mesh"):
        mesh = build_mesh(dims_)
    out["mesh_names"] = list(getattr(mesh, "mesh_dim_names", None) or [])
    out["mesh"] = {name: _ranks(mesh, name) for name in DIMS}
    want = {name: dims_.group_of(ctx.rank, name) for name in DIMS}
    if out["mesh"] != want:
        mesh = reference_build_mesh(dims_)   # judged above; the rest runs on the right one
    model = compose.gpt2_ready(config)
    reference = copy.deepcopy(model)
    with _Spy(parallelize) as spy, learner_part(ctx, "parallelize"):
        try:
            returned = parallelize(model, dims_, mesh)
        except Exception as exc:
            if shard_first(spy.calls):   # what torch says then is about meshes; the cause is the order
                raise ShardedFirst(SHARDED_FIRST + f" (torch said: {str(exc)[:120]})") from exc
            raise
        finally:
            out["calls"] = list(spy.calls)
    model = returned if returned is not None else model
    with learner_part(ctx, "which_batch"):
        shard, part = which_batch(ctx.rank, dims_)
    whole_in, whole_out = _whole_batch(config)
    rows = whole_in.shape[0] // dims_.dp
    mine = slice(shard * rows, (shard + 1) * rows)
    pos = cp.positions(SEQ, part, dims_.cp, "contiguous")
    inputs, targets = whole_in[mine][:, pos], whole_out[mine][:, pos]
    with learner_part(ctx, "parallelize"):
        logits = model(input_ids=inputs, position_ids=pos.expand(inputs.shape[0], -1)).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss.backward()
    ref_loss = F.cross_entropy(reference(input_ids=whole_in).logits.reshape(-1, logits.shape[-1]).float(),
                               whole_out.reshape(-1))
    ref_loss.backward()
    wanted = dict(reference.named_parameters())
    out["loss"], out["ref_loss"] = loss.item(), ref_loss.item()
    out["grads"] = {}
    # attention's key bias has no gradient in exact arithmetic (softmax ignores a shift of every score): rounding
    # noise, judged against a thousandth of the model's largest gradient as pipeline_check does
    floor = 1e-3 * max(p.grad.abs().max().item() for p in wanted.values() if p.grad is not None)
    for name, param in model.named_parameters():
        if name not in wanted or param.grad is None:
            continue
        got = _full(param.grad)
        want_grad = wanted[name].grad
        if got.shape != want_grad.shape:
            out["grads"][name] = {"shape": list(got.shape)}
            continue
        scale = (got * want_grad).sum() / (want_grad * want_grad).sum().clamp_min(1e-30)
        error = ((got - want_grad).abs().max() / want_grad.abs().max().clamp_min(floor)).item()
        out["grads"][name] = {"error": error, "scale": scale.item(), "probe": got.reshape(-1)[:6].tolist()}
    out["tp_split"] = _is_split(model)
    return out


def _whole_batch(config: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    from ..training.tasks import make_task
    return make_task(config, 1).batch(0, 0, 0)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient gathered whole. On a 2-D mesh DTensor warns that it gathers in two steps: a speed remark about a
    one-off gather, kept out of the learner's output."""
    import logging
    full = getattr(tensor, "full_tensor", None)
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return (full() if callable(full) else tensor).detach().float()
    finally:
        quiet.setLevel(level)


def _is_split(model: Any) -> bool:
    """Whether the first block's MLP weight is a DTensor cut over a "tp" dimension (TP applied)."""
    weight = model.transformer.h[0].mlp.c_fc.weight
    mesh = getattr(weight, "device_mesh", None)
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())
