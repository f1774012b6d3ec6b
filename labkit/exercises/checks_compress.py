"""Write DDP's gradient-compression hook yourself: cast each bucket to 16 bits, all-reduce, divide,
cast back; checked on 2 gloo ranks against the fp32 mean and torch's own fp16_compress_hook.

    def my_fp16_hook(process_group, bucket):  # DDP calls it with each bucket of gradients
        ...                                   # return a Future holding the bucket's mean, in fp32
    report = check_compression_hook(my_fp16_hook)
    my_fp16_hook = report.use(fp16_hook)      # yours if it passed
    hook_bytes(my_fp16_hook, config)          # bytes it hands all_reduce per step, config's model

The checker registers the hook on a DDP model (CheckNet: a tied weight, a frozen layer; a bucket cap
small enough for several buckets) on 2 ranks and runs two backwards (DDP rebuilds its buckets after
the first). CommProbe counts the bytes each rank hands to all_reduce (at the call, not by formula).
A second DDP copy of the model uses torch's default_hooks.fp16_compress_hook on the same data, and
each rank also computes its own gradient without DDP, so the reference (the mean of the ranks' fp32
gradients) is independent of the hook:

    runs       every rank finished (a raise names the rank and the learner's line; a hang, each
               rank's place)
    future     the hook returned a torch.futures.Future whose value is one tensor of the bucket's
               dtype (None, a Work, a list or an fp16 tensor are named; the checker stands in for
               DDP's copy so that the rest runs)
    bytes      2 bytes per gradient element handed to all_reduce (fp32's 4 is named as 2.000x:
               not compressed)
    gradients  within 16-bit rounding of the fp32 mean (2.000x: summed, not divided; each rank's
               own: the all-reduced values never reached the bucket), the same on both ranks
"""
# No `from __future__ import annotations`: DDP reads a hook's annotations (the real GradBucket).
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..run import launch
from ..training.commhooks import count_collectives
from ..training.tasks import make_task
from .checknet import build_checknet, check_batch, check_loss
from .learner import learner_part, run_checked
from .probe import CommProbe
from .report import Report

WORLD = 2
STEPS = 2          # DDP rebuilds its buckets after the first backward: both bucketings are checked
BUCKET_MB = 0.004  # ~1,000 fp32 elements a bucket: CheckNet's gradients travel in several buckets
# Of the largest gradient: bf16 rounds to 2**-8 relative, fp16 to 2**-11; a wrong hook: >= 0.5.
TOLERANCE = 1e-2


def fp16_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The reference: the bucket cast to fp16 and divided by the world size, all-reduced, cast back
    in a callback."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer
    return future.then(decompress)


def _watched(hook: Callable, ctx: Any, name: str, notes: list[str]) -> Callable:
    """The learner's hook as DDP sees it: what it returns is noted (and a wrong return stood in for,
    so that the run goes on and the report can say what it was), a raise is written down as the
    learner's."""
    def watched(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks annotations
        buffer = bucket.buffer()
        with learner_part(ctx, name):
            out = hook(state, bucket)
        # torch._C.Future is what get_future() gives; torch.futures.Future is a subclass of it
        if not isinstance(out, torch._C.Future):
            work = " (the Work: call .get_future() on it)" if hasattr(out, "get_future") else ""
            notes.append(f"returned {type(out).__name__}{work}")
            if hasattr(out, "wait"):
                out.wait()
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(buffer)
            return done

        def looked_at(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()
            if isinstance(value, (list, tuple)):
                notes.append(f"value is a {type(value).__name__} of {len(value)} tensor(s)")
                value = value[0]
            if isinstance(value, torch.Tensor) and value.dtype != buffer.dtype:
                notes.append(f"value is {str(value.dtype).replace('torch.', '')}")
            if isinstance(value, torch.Tensor) and value is not buffer:
                buffer.copy_(value)
            return buffer
        return out.then(looked_at)
    return watched


def _drive(ctx: Any, hook: Callable, name: str) -> dict[str, Any]:
    dist.barrier()
    mine = DDP(build_checknet(0), bucket_cap_mb=BUCKET_MB)
    torchs = DDP(build_checknet(0), bucket_cap_mb=BUCKET_MB)
    plain = build_checknet(0)
    notes: list[str] = []
    mine.register_comm_hook(None, _watched(hook, ctx, name, notes))
    torchs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out: dict[str, Any] = {"notes": notes, "steps": []}
    with CommProbe() as probe:
        for step in range(STEPS):
            inputs, targets = check_batch(step, ctx.rank, WORLD)
            grads = {}
            for label, model in (("mine", mine), ("torch", torchs), ("own", plain)):
                model.zero_grad(set_to_none=True)
                with probe.phase(label, step):
                    check_loss(model, inputs, targets).backward()
                module = model.module if isinstance(model, DDP) else model
                grads[label] = torch.cat([p.grad.reshape(-1) for p in module.parameters()
                                          if p.grad is not None])
            sent = [e for e in probe.of(phase="mine", step=step) if e["op"] == "all_reduce"]
            sent_bytes = sum(e["bytes"] for e in sent)
            out["steps"].append({**grads, "bytes": sent_bytes, "calls": len(sent)})
    return out


def check_compression_hook(hook: Callable, *, timeout: float = 20.0,
                           runs_root: Any = None) -> Report:
    """Register `hook` on DDP on 2 gloo ranks and report on it:
    check_compression_hook(my_fp16_hook).ok."""
    name = getattr(hook, "__name__", "your hook")
    report = Report(f"{name}: a 16-bit compression hook on DDP, {WORLD} gloo ranks",
                    implementation=hook)
    hint = ("Every rank's hook must all-reduce each bucket once, in the same order; the future it "
            "returns completes when that all-reduce does.")
    outcomes = run_checked(report, functools.partial(_drive, hook=hook, name=name),
                           world_size=WORLD, timeout=timeout, name=f"check-{name}",
                           runs_root=runs_root, hang_hint=hint)
    if outcomes is None:
        return report
    _future(report, outcomes, name)
    elements = outcomes[0]["steps"][0]["own"].numel()
    report.measured["elements"] = elements
    if _bytes(report, outcomes, elements, name):
        _gradients(report, outcomes, name)
    return report


def _future(report: Report, outcomes: list[dict], name: str) -> None:
    notes = list(dict.fromkeys(n for out in outcomes for n in out["notes"]))
    if not notes:
        report.add("future", "pass", "the hook returned a Future holding the bucket's tensor, in "
                                     "the bucket's dtype (float32)")
        return
    if any(n.startswith("returned") for n in notes):
        said = next(n for n in notes if n.startswith("returned"))
        report.add("future", "fail", f"your hook {said}, not a torch.futures.Future: DDP waits on "
                                     "the future a hook returns (dist.all_reduce(t, async_op=True)"
                                     ".get_future(), then .then(...) to cast back); the checker "
                                     "stood in for it to go on", part=name)
    elif any("list" in n or "tuple" in n for n in notes):
        said = next(n for n in notes if "list" in n or "tuple" in n)
        report.add("future", "fail", f"your hook's future: {said}, not one tensor: all_reduce's "
                                     "future holds a list; in your .then callback take "
                                     "fut.value()[0], cast it back, return it", part=name)
    else:
        said = next(n for n in notes if n.startswith("value is"))
        report.add("future", "fail", f"not cast back: your hook's future {said}, the bucket is "
                                     "float32: cast the all-reduced tensor back (buffer.copy_(...) "
                                     "or .to(buffer.dtype)) in a .then callback and return that",
                   part=name)


def _bytes(report: Report, outcomes: list[dict], elements: int, name: str) -> bool:
    per = [s["bytes"] / elements for out in outcomes for s in out["steps"]]
    report.measured["bytes_per_element"] = max(per)
    report.measured["bytes"] = outcomes[0]["steps"][-1]["bytes"]
    if max(per) == 0:
        report.add("bytes", "fail", "your hook handed nothing to dist.all_reduce: each bucket must "
                                    "be all-reduced (call it as dist.all_reduce(...), so that the "
                                    "checker sees it)", part=name)
        return False
    if max(per) > 2.0:
        report.add("bytes", "fail", f"your hook handed all_reduce {max(per):.2f} bytes per "
                                    f"gradient element, {max(per) / 2:.3f}x the fp16 hook's 2: not "
                                    "compressed; cast the bucket to torch.float16 (or bfloat16) "
                                    "before the all-reduce", part=name)
        return False
    report.add("bytes", "pass", f"2 bytes per gradient element on the wire "
                                f"({report.measured['bytes']:,} bytes a step for {elements:,} "
                                "elements), half of fp32's")
    return True


def _gradients(report: Report, outcomes: list[dict], name: str) -> None:
    for step in range(STEPS):
        mean = sum(out["steps"][step]["own"] for out in outcomes) / WORLD
        scale = mean.abs().max().item()
        torch_err = max((out["steps"][step]["torch"] - mean).abs().max().item() / scale
                        for out in outcomes)
        report.measured["torch_fp16_error"] = torch_err
        for rank, out in enumerate(outcomes):
            got = out["steps"][step]["mine"]
            err = (got - mean).abs().max().item() / scale
            report.measured["error"] = max(err, report.measured.get("error", 0.0))
            if err <= TOLERANCE:
                continue
            ratio = torch.dot(got, mean).item() / torch.dot(mean, mean).item()
            own = out["steps"][step]["own"]
            if abs(ratio - WORLD) < 0.05:
                why = (f"gradients are {ratio:.3f}x the mean: all_reduce sums; divide by the world "
                       f"size ({WORLD}) before or after it")
            elif (got - own).abs().max().item() / scale <= TOLERANCE:
                why = ("gradients are this rank's own, not the mean: the all-reduced values never "
                       "reached the bucket")
            else:
                why = (f"gradients are off the fp32 mean by {err:.1%} of the largest (ratio "
                       f"{ratio:.3f}x), more than 16-bit rounding ({TOLERANCE:.0%}; torch's fp16 "
                       f"hook: {torch_err:.2%})")
            report.add("gradients", "fail", f"step {step}, rank {rank}: {why}", part=name)
            return
        if not torch.equal(outcomes[0]["steps"][step]["mine"], outcomes[1]["steps"][step]["mine"]):
            report.add("gradients", "fail", f"step {step}: ranks 0 and 1 hold different gradients: "
                                            "their weights would part; every rank must get the "
                                            "same all-reduced bucket", part=name)
            return
    err, torch_err = report.measured["error"], report.measured["torch_fp16_error"]
    report.add("gradients", "pass", f"the fp32 mean within 16-bit rounding ({err:.2%} of the "
                                    f"largest; torch's fp16 hook: {torch_err:.2%}), the same on "
                                    "both ranks")


def _one_run(ctx: Any, hook: Callable, config: RunConfig, steps: int) -> list[int]:
    task = make_task(config)
    torch.manual_seed(config.seed)
    ddp = DDP(task.build_model())
    ddp.register_comm_hook(None, hook)
    sent = []
    with count_collectives() as wire:
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            loss, _ = task.loss(ddp, *task.batch(step, 0, ctx.rank))
            loss.backward()
            sent.append(wire.take()[1])
    return sent


def hook_bytes(hook: Callable, config: RunConfig, steps: int = 2) -> list[int]:
    """Bytes rank 0 handed to collectives at each of `steps` backwards of `config`'s model under DDP
    with `hook`, on config.world_size gloo ranks:
    hook_bytes(fp16_hook, RunConfig(task="tinylm")) -> [n, n]."""
    run = launch(functools.partial(_one_run, hook=hook, config=config, steps=steps),
                 world_size=config.world_size, echo=False, progress=False, name="hook bytes")
    return run.result(0)
