"""Inside each rank: drive a learner's DDP wrapper through a few training steps, watched, and keep what it did.

    outcome = drive_ddp(ctx, MyDDP, {"bucket_size_mb": 0.01}, steps=3)     # a dict the checker reads back

Each rank wraps a CheckNet initialised from its own seed (separate processes initialise separately: the wrapper's
broadcast must fix that), and trains it with SGD on its rows of each step's batch. Before each step the rank also
computes, from its current parameters, the single-process gradient of the whole batch and the gradient of its own
rows alone: what a correct wrapper must produce, and what an unsynchronised one leaves.

Besides what CommProbe sees, each collective is labelled with the learner's function that made it (Class.method),
point-to-point calls (send, recv, isend, irecv) are noted, the gradient hooks the constructor registered are named,
and, the moment finish_gradient_synchronization() returns, every async collective of the step must have been waited
for (wait() on its handle, or its future taken): checked from the calls made, not from timing.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .checknet import build_checknet, check_batch, check_loss, global_batch_for, grad_snapshot, param_names, snapshot
from .learner import is_learners, learner_part
from .probe import PAYLOAD, CommProbe, payload_bytes

SEED = 1234
LR = 0.1
P2P = ("send", "recv", "isend", "irecv")
_HERE = os.path.dirname(os.path.abspath(__file__))


def reference_run(steps: int, global_batch: int) -> list[dict[str, torch.Tensor]]:
    """One process on the whole batch, from rank 0's start: the parameters after each SGD step."""
    model = build_checknet(SEED)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    params = []
    for step in range(steps):
        check_loss(model, *check_batch(step, 0, 1, global_batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        params.append(snapshot(model))
    return params


def expected_grads(model: torch.nn.Module, step: int, rank: int, world_size: int) -> tuple[dict, dict]:
    """At `model`'s current parameters: the single-process gradient of the whole batch, and the gradient of this
    rank's rows alone (what a rank holds if nothing is averaged)."""
    batch = global_batch_for(world_size)
    whole, mine = build_checknet(SEED), build_checknet(SEED)
    for copy, (inputs, targets) in ((whole, check_batch(step, 0, 1, batch)),
                                    (mine, check_batch(step, rank, world_size, batch))):
        copy.load_state_dict(model.state_dict())
        check_loss(copy, inputs, targets).backward()
    return grad_snapshot(whole), grad_snapshot(mine)


def learner_function(frames: Any) -> str:
    """The qualified name (Class.method) of the innermost frame of the learner's code among `frames` (outermost
    first), or ""."""
    found = ""
    for frame in frames:
        if is_learners(frame.f_code.co_filename):
            found = getattr(frame.f_code, "co_qualname", frame.f_code.co_name).split(".<locals>")[0]
    return found


@contextlib.contextmanager
def learner_call(ctx: Any, default: str, step: int = -1) -> Iterator[None]:
    """learner_part, with the part named by the learner's innermost function that raised (a hook raising inside
    backward is named as the hook), else `default`."""
    try:
        yield
    except BaseException as exc:
        part = learner_function(frame for frame, _ in traceback.walk_tb(exc.__traceback__)) or default
        with learner_part(ctx, part, step):
            raise


def learner_caller() -> str:
    """The learner's function that called into the current collective (innermost learner frame on the stack below
    the checker's drive_* function: a forked rank's stack goes on into whatever launched the check)."""
    frame, frames = sys._getframe(2), []
    while frame is not None and not (frame.f_code.co_name.startswith("drive_")
                                     and frame.f_code.co_filename.startswith(_HERE)):
        frames.append(frame)
        frame = frame.f_back
    return learner_function(reversed(frames))


class _NotedWork:
    """A collective's handle, noting whether the learner waited for it (wait(), or took its future to wait on)."""

    def __init__(self, work: Any, event: dict[str, Any]):
        self._work, self._event = work, event

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._event["waited"] = True
        return self._work.wait(*args, **kwargs)

    def get_future(self) -> Any:
        self._event["waited"] = True
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def noted(probe: CommProbe, p2p: list[dict[str, Any]], hooks: list[tuple[int, str]]) -> Iterator[None]:
    """While open: label each probed collective with the learner's function that made it, note point-to-point
    calls in `p2p`, and the learner's functions registered as gradient hooks in `hooks` (id(tensor), function)."""
    saved: dict[Any, dict[str, Any]] = {dist: {}, torch.Tensor: {}}

    def labelled(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            before = len(probe.events)
            result = original(*args, **kwargs)
            if len(probe.events) > before:
                event = probe.events[before]
                event["caller"] = learner_caller()
                if event["async_op"] and result is not None:
                    return _NotedWork(result, event)
            return result
        return call

    def point_to_point(name: str, original: Any) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not probe._paused:
                p2p.append({"op": name, "bytes": payload_bytes(tensor), "phase": probe.current_phase,
                            "step": probe.current_step, "caller": learner_caller()})
            return original(tensor, *args, **kwargs)
        return call

    def hook_noting(original: Any) -> Any:
        def register(tensor: Any, hook: Any, *args: Any, **kwargs: Any) -> Any:
            code = getattr(hook, "__code__", None) or getattr(getattr(hook, "__func__", None), "__code__", None)
            if code is not None and is_learners(code.co_filename):
                hooks.append((id(tensor), getattr(code, "co_qualname", code.co_name).split(".<locals>")[0]))
            return original(tensor, hook, *args, **kwargs)
        return register

    for name in PAYLOAD:
        if getattr(dist, name, None) is not None:
            saved[dist][name] = getattr(dist, name)
            setattr(dist, name, labelled(saved[dist][name]))
    for name in P2P:
        saved[dist][name] = getattr(dist, name)
        setattr(dist, name, point_to_point(name, saved[dist][name]))
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        saved[torch.Tensor][name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, hook_noting(saved[torch.Tensor][name]))
    try:
        yield
    finally:
        for owner, names in saved.items():
            for name, original in names.items():
                setattr(owner, name, original)


def drive_ddp(ctx: Any, wrapper_cls: Any, kwargs: dict[str, Any], steps: int) -> dict[str, Any]:
    """Wrap a CheckNet (initialised differently on each rank) in `wrapper_cls(model, **kwargs)` and train it for
    `steps` SGD steps on this rank's rows, recording parameters, gradients, collectives and times."""
    model = build_checknet(SEED + ctx.rank)  # separate processes initialise separately: the broadcast must fix it
    names = param_names(model)
    batch = global_batch_for(ctx.world_size)
    cls = getattr(wrapper_cls, "__qualname__", getattr(wrapper_cls, "__name__", "wrapper"))
    p2p: list[dict[str, Any]] = []
    hooks: list[tuple[int, str]] = []
    out: dict[str, Any] = {"rank": ctx.rank, "reference": reference_run(steps, batch), "own_init": snapshot(model),
                           "steps": [], "params": param_table(model, names), "class": cls}
    with CommProbe() as probe, noted(probe, p2p, hooks):
        with learner_call(ctx, f"{cls}.__init__"), probe.phase("constructor"):
            wrapped = wrapper_cls(model, **kwargs)
        out["after_init"] = snapshot(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        for step in range(steps):
            ctx.heartbeat(step)
            expected, local = expected_grads(model, step, ctx.rank, ctx.world_size)
            inputs, targets = check_batch(step, ctx.rank, ctx.world_size, batch)
            with learner_call(ctx, f"{cls}.forward", step), probe.phase("forward", step):
                loss = check_loss(wrapped, inputs, targets)
            with learner_call(ctx, "backward (your gradient hooks run here)", step), probe.phase("backward", step):
                backward_start = time.perf_counter()
                loss.backward()
                backward_end = time.perf_counter()
            with learner_call(ctx, f"{cls}.finish_gradient_synchronization", step), probe.phase("finish", step):
                wrapped.finish_gradient_synchronization()
            finish_end = time.perf_counter()
            unwaited = [e.get("caller", "") for e in probe.events
                        if e["step"] == step and e["async_op"] and not e["waited"]]
            out["steps"].append({"grads": grad_snapshot(model), "expected": expected, "local": local,
                                 "tensors": _tensor_names(model, names),
                                 "backward_start": backward_start, "backward_end": backward_end,
                                 "finish_end": finish_end, "unfinished": probe.unfinished(step),
                                 "unwaited": unwaited})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out["steps"][-1]["params"] = snapshot(model)
        with probe.paused():
            dist.barrier()  # no rank leaves while a peer's async work may still be in flight
    label = {id(p): " = ".join(names[id(p)]) for p in model.parameters()}
    counts = {(label.get(t, "a tensor"), hook): sum(1 for h in hooks if h == (t, hook)) for t, hook in hooks}
    out.update(events=probe.events, p2p=p2p, hooks=list(dict.fromkeys(hook for _, hook in hooks)),
               hooked_twice=[(name, hook, n) for (name, hook), n in counts.items() if n > 1])
    return out


def param_table(model: torch.nn.Module, names: dict[int, list[str]]) -> list[dict[str, Any]]:
    """One row per parameter tensor: its names, bytes, whether it is trained."""
    return [{"name": names[id(p)][0], "label": " = ".join(names[id(p)]), "tied": len(names[id(p)]) > 1,
             "numel": p.numel(), "bytes": p.numel() * p.element_size(),
             "requires_grad": p.requires_grad} for p in model.parameters()]


def _tensor_names(model: torch.nn.Module, names: dict[int, list[str]]) -> dict[int, str]:
    """data_ptr -> what lives there: a parameter's gradient or the parameter itself (to name all-reduced tensors)."""
    found: dict[int, str] = {}
    for param in model.parameters():
        label = " = ".join(names[id(param)])
        found[param.data_ptr()] = f"parameter {label}"
        if param.grad is not None:
            found[param.grad.data_ptr()] = f"gradient {label}"
    return found
