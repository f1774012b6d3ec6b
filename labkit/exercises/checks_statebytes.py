"""Model-state bytes per GPU, worked out before they are measured (lesson 17): the learner's pure function, judged
on a 70B-parameter model against labkit.memory's formula, then on the lesson's tiny GPT-2 against the bytes two
real gloo ranks hold.

    def state_bytes_per_gpu(num_params, stage, tp, n_gpus, *, param_bytes=2, grad_bytes=2, k=12):
        ...                                   # bytes of parameters + gradients + optimizer state on one GPU
    report = check_state_bytes(state_bytes_per_gpu)
    report.measured["toy"]                    # what each rank held, by part, at stages 0 and 1
    state_bytes_per_gpu = report.use(model_state_bytes_per_gpu)     # yours once it passed

The model (ZeRO, Rajbhandari et al. 2020; labkit.memory): Ψ parameters, tensor parallelism of degree t splits every
layer first (Ψ/t on a GPU), then ZeRO shards over the N/t data-parallel ranks: the optimizer state from stage 1,
the gradients from stage 2, the parameters at stage 3. Mixed precision with Adam: 2-byte parameters and gradients,
K = 12 bytes of optimizer state per parameter (an fp32 master copy, momentum and variance).

    formula  70B parameters on 1024 GPUs, stages 0-3, t = 1 and 8, the defaults (mixed precision): every value is
             labkit.memory.model_state_bytes's; a wrong set is named as the usual slip that gives the same numbers
             everywhere (parameters or GB for bytes; K = 0, 4 or 8 for 12; N for N/t; t not divided; a stage off by
             one), else by its first wrong point
    toy      on 2 gloo ranks, the lesson's tiny GPT-2 in fp32 with AdamW (param_bytes=4, grad_bytes=4, k=8: Adam's
             two fp32 moments, no master copy since the parameters are fp32 already), one training step under
             torch's DDP (stage 0) and under torch's ZeroRedundancyOptimizer (stage 1): the learner's bytes against
             the parameters, gradients and optimizer state the ranks held (AdamW's one-number `step` counters left
             out; at stage 1 the ranks' mean, since a parameter's state goes whole to one rank)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from ..memory import model_state_bytes, state_breakdown
from ..training.tasks import make_task
from .holdings import state_holdings
from .learner import learner_part, run_checked
from .checks_formulas import close, said_number
from .report import Report
from .speeds import tinylm_config

PSI, N_GPUS, STAGES, TPS = 70e9, 1024, (0, 1, 2, 3), (1, 8)
TOY = {"param_bytes": 4, "grad_bytes": 4, "k": 8}   # fp32 parameters and gradients, AdamW's two fp32 moments
WORLD = 2


def model_state_bytes_per_gpu(num_params: float, stage: int, tp: int, n_gpus: int, *, param_bytes: float = 2,
                              grad_bytes: float = 2, k: float = 12) -> float:
    """labkit's reference: parameters, gradients and optimizer state one GPU holds at ZeRO `stage` (0: DDP) with
    tensor parallelism of degree `tp` on `n_gpus` GPUs (data-parallel degree n_gpus / tp), in bytes."""
    psi, dp = num_params / tp, n_gpus // tp
    return (param_bytes * psi / (dp if stage >= 3 else 1) + grad_bytes * psi / (dp if stage >= 2 else 1)
            + k * psi / (dp if stage >= 1 else 1))


def _grid() -> list[tuple[int, int]]:
    return [(stage, tp) for tp in TPS for stage in STAGES]


def _want(stage: int, tp: int) -> float:
    """labkit.memory's number (independent of model_state_bytes_per_gpu): the checker's reference."""
    return model_state_bytes(PSI, stage=stage, dp=N_GPUS // tp, tp=tp)


def _slips() -> dict[str, Callable[[int, int], float]]:
    """Wrong models a learner writes, each with the sentence that names it (tried in this order), as functions of
    (stage, tp) on the 70B grid."""
    def ms(stage: int, tp: int, *, dp: int | None = None, psi_tp: int | None = None, k: float = 12,
           pb: float = 2, gb: float = 2) -> float:
        s = min(max(stage, 0), 3)
        return state_breakdown(PSI, stage=s, dp=dp or N_GPUS // tp, tp=psi_tp or tp, param_bytes=pb,
                               grad_bytes=gb, k=k).total

    def params_held(stage: int, tp: int) -> float:
        return PSI / tp / (N_GPUS // tp if stage >= 3 else 1)

    return {
        "that is the number of parameters a GPU holds, not bytes: each parameter costs 2 + 2 + 12 bytes here "
        "(parameter, gradient, Adam's state)": params_held,
        "elements, not bytes: 1 per parameter, gradient and each of Adam's 3 fp32 tensors; multiply by their "
        "bytes (2, 2, 4 + 4 + 4)": lambda s, t: ms(s, t, pb=1, gb=1, k=3),
        "gigabytes (1e9), not bytes: return bytes": lambda s, t: _want(s, t) / 1e9,
        "GiB (2**30), not bytes: return bytes": lambda s, t: _want(s, t) / 2**30,
        "K = 8: Adam's two moments counted, the fp32 master weights forgotten (mixed precision keeps an fp32 copy "
        "of each parameter too: K = 4 + 4 + 4 = 12)": lambda s, t: ms(s, t, k=8),
        "K = 4: one fp32 copy counted, Adam's two moments forgotten (K = 12: master weights, momentum, "
        "variance, 4 bytes each)": lambda s, t: ms(s, t, k=4),
        "no optimizer state: K = 12 bytes per parameter forgotten (fp32 master weights, momentum, "
        "variance)": lambda s, t: ms(s, t, k=0),
        "sharded over all N GPUs: ZeRO shards over the data-parallel degree N/t (the t tensor-parallel ranks of a "
        "group already hold different pieces)": lambda s, t: ms(s, t, dp=N_GPUS),
        "tensor parallelism not divided: each GPU holds 1/t of every layer, so the bytes are divided by t as "
        "well as sharded over N/t": lambda s, t: ms(s, t, psi_tp=1),
        "the TP degree t ignored: neither Ψ divided by t nor sharding over N/t": lambda s, t: ms(s, t, psi_tp=1,
                                                                                                dp=N_GPUS),
        "a stage off by one, sharded one stage early (e.g. gradients at stage 1): stage 1 shards the optimizer "
        "state only, stage 2 the gradients too, stage 3 the parameters too": lambda s, t: ms(s + 1, t),
        "a stage off by one, sharded one stage late: stage 0 is plain DDP, stage 1 already shards the optimizer "
        "state": lambda s, t: ms(s - 1, t),
    }



def _held(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds: parameters, gradients, optimizer state (holdings.py's walk), and of that state the
    one-number tensors (AdamW's `step` counters, not per-parameter state)."""
    params = list(model.parameters())
    inner = getattr(optimizer, "optim", optimizer)   # ZeroRedundancyOptimizer keeps a local optimizer
    counters = sum(v.numel() * v.element_size() for state in inner.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.numel() == 1)
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer": state_holdings(optimizer, params).bytes, "counters": counters}


def _drive(ctx: Any, fn: Callable, name: str) -> dict[str, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    with learner_part(ctx, name):
        grid = [fn(PSI, stage, tp, N_GPUS) for stage, tp in _grid()]
    config = tinylm_config(ctx.world_size)
    task = make_task(config, ctx.world_size)
    held, psi = {}, 0
    for stage in (0, 1):
        ctx.heartbeat()   # progress between the phases: busy cores slow them, they do not hang
        torch.manual_seed(config.seed)
        model = task.build_model()
        psi = sum(p.numel() for p in model.parameters())
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if stage == 0 else
                     ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3))
        loss, _ = task.loss(ddp, *task.batch(0, 0, ctx.rank))
        loss.backward()
        optimizer.step()   # optimizers create their state on the first step
        held[stage] = _held(model, optimizer)
    with learner_part(ctx, name):
        toy = {stage: fn(psi, stage, 1, ctx.world_size, **TOY) for stage in (0, 1)}
        mixed = {stage: fn(psi, stage, 1, ctx.world_size) for stage in (0, 1)}
    return {"grid": grid, "toy": toy, "mixed": mixed, "held": held, "psi": psi}


def check_state_bytes(fn: Callable, *, timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Judge `fn(num_params, stage, tp, n_gpus, *, param_bytes, grad_bytes, k)` on the 70B grid and on 2 gloo
    ranks:  check_state_bytes(state_bytes_per_gpu).ok."""
    name = getattr(fn, "__name__", "state_bytes_per_gpu")
    report = Report(f"{name}: model-state bytes per GPU, 70B on {N_GPUS} GPUs and the tiny GPT-2 on {WORLD} "
                    "gloo ranks", implementation=fn)
    outcomes = run_checked(report, functools.partial(_drive, fn=fn, name=name), world_size=WORLD,
                           timeout=timeout, name=f"check-{name}", runs_root=runs_root,
                           hang_hint="Your function computes a number: it needs no collective, and should not "
                                     "call one.")
    if outcomes is None:
        return report
    if _formula(report, outcomes[0]["grid"], name):
        _toy(report, outcomes, name)
    return report


def _formula(report: Report, got: list[Any], name: str) -> bool:
    points = _grid()
    want = [_want(*p) for p in points]
    report.measured["70B"] = {f"stage {s}, t={t}": g for (s, t), g in zip(points, got)}
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if not close(g, w)]
    if not wrong:
        report.add("formula", "pass", f"70B parameters on {N_GPUS} GPUs, stages 0-3, t = 1 and 8: every value "
                                      f"is labkit.memory's (stage 0, t=1: {want[0] / 1e9:,.0f} GB; stage 3: "
                                      f"{want[3] / 1e9:.2f} GB)")
        return True
    for why, slip in _slips().items():
        if all(close(g, slip(*p)) for g, p in zip(got, points)):
            report.add("formula", "fail", f"70B on {N_GPUS} GPUs: {why}", part=name)
            return False
    i = wrong[0]
    stage, tp = points[i]
    said = next((why for why, slip in _slips().items() if close(got[i], slip(stage, tp))), None)
    report.add("formula", "fail", f"70B on {N_GPUS} GPUs at stage {stage}, t={tp}: your {said_number(got[i])} bytes, "
                                  f"the formula's {want[i]:.6g} ({len(wrong)} of {len(points)} points wrong)"
                                  + (f"; there it is {said}" if said else ""), part=name)
    return False



def _toy(report: Report, outcomes: list[dict], name: str) -> None:
    psi, first = outcomes[0]["psi"], outcomes[0]
    report.measured["toy"] = {f"stage {s}": [o["held"][s] for o in outcomes] for s in (0, 1)}
    for stage, what in ((0, "every rank held under torch's DDP"),
                        (1, "the ranks held on average under torch's ZeroRedundancyOptimizer")):
        held = [o["held"][stage] for o in outcomes]
        per_rank = [h["params"] + h["grads"] + h["optimizer"] - h["counters"] for h in held]
        measured = per_rank[0] if stage == 0 else sum(per_rank) / len(per_rank)
        got = first["toy"][stage]
        if stage == 0 and len(set(per_rank)) > 1:
            raise AssertionError(f"DDP ranks held different bytes: {per_rank}")   # labkit's own measurement
        if not close(got, measured):
            ignored = close(got, first["mixed"][stage])
            why = ("param_bytes, grad_bytes and k were ignored: the toy runs in fp32 with AdamW (4 + 4 + 8 bytes "
                   "per parameter), and your function gave the mixed-precision number" if ignored else
                   f"{_ratio(got, measured)} what the ranks held "
                   f"({held[0]['params']:,} B of parameters, {held[0]['grads']:,} of gradients, "
                   f"{held[0]['optimizer'] - held[0]['counters']:,} of Adam's moments on rank 0)")
            report.add("toy", "fail", f"the tiny GPT-2 (Ψ = {psi:,}) at stage {stage} on {WORLD} ranks, "
                                      f"fp32 (param_bytes=4, grad_bytes=4, k=8): your {said_number(got)} bytes; {why}",
                       part=name)
            return
        report.add("toy", "pass", f"the tiny GPT-2 (Ψ = {psi:,}), fp32 AdamW, stage {stage} on {WORLD} gloo ranks: "
                                  f"{measured:,.0f} B, what {what} (AdamW's step counters aside)")


def _ratio(got: Any, measured: float) -> str:
    try:
        return f"{float(got) / measured:.3f}x"
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return "not a number of bytes:"
