"""Tensor parallelism's bytes, worked out before they are counted (lesson 27): the all-reduce bytes one rank sends
per transformer block, and the activations it keeps per block with and without recomputation, two pure functions
judged against the formulas on a GPT-3-sized layer, then against two real gloo ranks running the tiny GPT-2 split
by torch's tensor parallelism.

    def tp_allreduce_bytes(seq, batch, hidden, tp, *, value_bytes=2): ...
    def kept_per_layer(seq, batch, hidden, heads, tp, *, recompute=False, value_bytes=2, whole=4, split=12,
                       masks=2, score_bytes=5): ...
    report = check_tp_bytes(tp_allreduce_bytes, kept_per_layer)
    report.measured["toy"]                      # what the ranks sent and kept, per block
    tp_allreduce_bytes, kept_per_layer = report.use(TP_BYTES_REFERENCE)    # yours once they passed

What is counted. All-reduce bytes: the bytes ONE tensor-parallel rank sends for ONE block in one training step
without recomputation: Megatron's 4 all-reduces (2 in forward after the row-parallel layers, 2 in backward for the
column-parallel layers' input gradients), each of s·b·h values, each a ring that sends 2(t-1)/t of its tensor from
every rank: 4 · 2(t-1)/t · s·b·h · value_bytes. Activations: Korthikanti et al. (2022, section 4) per layer and
rank, tensor parallelism without sequence parallelism: `whole` values of s·b·h kept whole, `split` divided by t,
`masks` bytes of s·b·h of dropout masks, and the attention scores, a·s²·b elements of `score_bytes` divided by t;
with full recomputation the layer's input only, s·b·h values (labkit.memory.activation_bytes).

    formula   a GPT-3 layer (s = 2048, b = 1, h = 12288, a = 96), t = 1, 2, 8, the defaults (2-byte values, the
              paper's 4 + 12, masks and scores): the all-reduce bytes against the ring model for 4 all-reduces
              (parallel.received_bytes), the activations against labkit.memory.activation_bytes, with and without
              recomputation; a wrong set is named as the usual slip giving the same numbers everywhere
    toy       2 gloo ranks, the tiny GPT-2 split by torch's DTensor plan, one forward and backward, fp32:
              the bytes each rank wrote to its sockets for the all-reduces (the ring model's where the kernel's
              counters are not readable), and the bytes autograd kept inside each block, without recomputation and
              with torch's checkpoint_wrapper on every block; the learner's numbers at the toy's keywords
              (value_bytes=4, split=26, masks=0, score_bytes=0) within 1% (what the simple model leaves out: the
              LayerNorms' statistics and the attention's log-sum-exp, under 1%)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..memory import activation_bytes
from ..training.parallel.dispatchcount import DispatchCounter
from ..training.parallel.recompute import recompute_blocks
from ..training.parallel.tensor_parallel import linear_gpt2, split_blocks
from ..training.tasks import make_task
from ..tricks.parallel import (GPT2_ON_CPU, SavedByBlock, WIRE_UNMEASURED, lesson_config, received_bytes,
                               written_bytes)
from .learner import learner_part, run_checked
from .checks_formulas import close, said_number
from .report import Report

TOY_REL, WIRE_REL = 0.01, 0.03   # the wire: gloo's message headers on top of the ring model
GPT3 = {"seq": 2048, "batch": 1, "hidden": 12288, "heads": 96}
TPS = (1, 2, 8)
SENT_POINTS = [(t, vb) for t in TPS for vb in (2, 4)]   # bf16 and fp32 values: bytes told from values
TOY = {"value_bytes": 4, "split": GPT2_ON_CPU["split_values"], "masks": 0, "score_bytes": 0}   # fp32, no dropout
WORLD = 2


def tp_allreduce_bytes(seq: int, batch: int, hidden: int, tp: int, *, value_bytes: float = 2) -> float:
    """labkit's reference: 4 ring all-reduces of s·b·h values, each sending 2(t-1)/t of its tensor per rank."""
    return 4 * 2 * (tp - 1) / tp * seq * batch * hidden * value_bytes


def kept_per_layer(seq: int, batch: int, hidden: int, heads: int, tp: int, *, recompute: bool = False,
                   value_bytes: float = 2, whole: float = 4, split: float = 12, masks: float = 2,
                   score_bytes: float = 5) -> float:
    """labkit's reference: Korthikanti et al.'s bytes per layer and rank; the layer's input alone if recomputed."""
    sbh = seq * batch * hidden
    if recompute:
        return sbh * value_bytes
    return sbh * ((whole + split / tp) * value_bytes + masks) + heads * seq * seq * batch * score_bytes / tp


TP_BYTES_REFERENCE = (tp_allreduce_bytes, kept_per_layer)


# --- the formulas' side: a GPT-3 layer -----------------------------------------------------------------------

def _want_sent(tp: int, value_bytes: int) -> float:
    sbh = GPT3["seq"] * GPT3["batch"] * GPT3["hidden"]
    return received_bytes({"all_reduce": 4 * sbh * value_bytes}, tp)   # a rank sends what its ring peer receives


def _want_kept(tp: int, recompute: bool) -> float:
    return activation_bytes(**GPT3, tp=tp, recompute="full" if recompute else "none")


def _sent_slips() -> dict[str, Callable[[int, int], float]]:
    sbh = GPT3["seq"] * GPT3["batch"] * GPT3["hidden"]   # values of one all-reduced tensor

    def ring(t: int) -> float:
        return 2 * (t - 1) / t
    return {
        "value_bytes ignored: 2-byte values whatever value_bytes says": lambda t, vb: 4 * ring(t) * sbh * 2,
        "half the bytes: forward only, the 2 all-reduces of backward forgotten (a factor 2 for forward and "
        "backward); or (t-1)/t without the 2, a reduce-scatter's bytes (an all-reduce is a reduce-scatter then an "
        "all-gather)": lambda t, vb: 2 * ring(t) * sbh * vb,
        "values, not bytes: multiply by value_bytes": lambda t, vb: 4 * ring(t) * sbh,
        "the ring's 2(t-1)/t forgotten: each all-reduce counted as its tensor's bytes": lambda t, vb: 4 * sbh * vb,
        "N for N - 1: 2t/t = 2 tensors per all-reduce; a ring sends 2(t-1)/t of the tensor, each of its 2(t-1) "
        "steps a 1/t chunk": lambda t, vb: 8 * sbh * vb,
        "divided by t: the all-reduced tensor is the block's whole output, s·b·h on every rank, not split":
            lambda t, vb: 4 * ring(t) * sbh * vb / t,
        "every rank's bytes together: the question is what ONE rank sends":
            lambda t, vb: t * 4 * ring(t) * sbh * vb,
    }


def _kept_slips() -> dict[str, Callable[[int, bool], float]]:
    g = GPT3
    sbh, scores = g["seq"] * g["batch"] * g["hidden"], g["heads"] * g["seq"] ** 2 * g["batch"]

    def paper(t: int, *, vb: float = 2, masks: float = 2, sb: float = 5, whole_t: int = 1, scores_t: int | None = None,
              rec: float | None = None, recompute: bool = False) -> float:
        if recompute and rec is not None:
            return rec
        if recompute:
            return sbh * vb
        return sbh * ((4 / whole_t + 12 / t) * vb + masks / whole_t) + scores * sb / (scores_t or t)
    return {
        "tensor parallelism not divided: the 12 split values and the scores are divided by t on each rank":
            lambda t, r: paper(1, recompute=r),
        "the attention scores not divided by t: each rank computes a/t of the heads": lambda t, r: paper(
            t, scores_t=1, recompute=r),
        "everything divided by t: that is sequence parallelism; tensor parallelism alone keeps the 4 whole values "
        "and the masks on every rank": lambda t, r: paper(t, whole_t=t, recompute=r),
        "values, not bytes: multiply by value_bytes": lambda t, r: paper(t, vb=1, rec=sbh, recompute=r),
        "the dropout masks forgotten (masks: bytes of s·b·h, 2 one-byte masks)": lambda t, r: paper(
            t, masks=0, recompute=r),
        "the attention scores forgotten (a·s²·b elements of score_bytes, split over t)": lambda t, r: paper(
            t, sb=0, recompute=r),
        "recomputation keeps nothing: each layer still keeps its input, s·b·h values": lambda t, r: paper(
            t, rec=0, recompute=r),
        "recomputation ignored: a recomputed layer keeps its input only, s·b·h values": lambda t, r: paper(t),
        "a recomputed layer's input split over t: without sequence parallelism it is whole on every rank":
            lambda t, r: paper(t, rec=sbh * 2 / t, recompute=r),
    }




# --- the ranks' side: the tiny GPT-2 split over 2 ranks --------------------------------------------------------

def _kept_inside(model: torch.nn.Module, task: Any, inputs: torch.Tensor,
                 targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    with SavedByBlock(model) as saved:
        loss, _ = task.loss(model, inputs, targets)
    return loss, saved.inside / len(list(model.transformer.h))


def _drive(ctx: Any, sent_fn: Callable, kept_fn: Callable) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    config = lesson_config("tp", ctx.world_size, steps=1)
    task = make_task(config, 1)
    model_config = task.build_model().config
    shape = {"seq": config.seq_len, "batch": config.global_batch, "hidden": model_config.n_embd}
    values = {"shape": {**shape, "heads": model_config.n_head}}
    with learner_part(ctx, getattr(sent_fn, "__name__", "tp_allreduce_bytes")):
        values["sent_grid"] = [sent_fn(GPT3["seq"], GPT3["batch"], GPT3["hidden"], t, value_bytes=vb)
                               for t, vb in SENT_POINTS]
        values["sent_toy"] = sent_fn(**shape, tp=ctx.world_size, value_bytes=TOY["value_bytes"])
    with learner_part(ctx, getattr(kept_fn, "__name__", "kept_per_layer")):
        values["kept_grid"] = [kept_fn(**GPT3, tp=t, recompute=r) for t in TPS for r in (False, True)]
        values["kept_toy"] = [kept_fn(**shape, heads=model_config.n_head, tp=ctx.world_size, recompute=r, **TOY)
                              for r in (False, True)]
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    out: dict[str, Any] = {}
    for recompute in (False, True):
        ctx.heartbeat()   # progress between the phases: busy cores slow them, they do not hang
        torch.manual_seed(config.seed)
        model = split_blocks(linear_gpt2(task.build_model()), mesh)
        if recompute:
            recompute_blocks(model, "full")
        inputs, targets = task.batch(0, 0, 0)
        with DispatchCounter() as wire:
            written = written_bytes()
            loss, kept = _kept_inside(model, task, inputs, targets)
            loss.backward()
            written = written_bytes() - written
            kinds = {kind: n for kind, (n, _) in wire.take_kinds().items()}
            calls, handed = wire.take()
        blocks = len(list(model.transformer.h))
        out["full" if recompute else "none"] = {"kept": kept, "written": written / blocks,
                                                "handed": handed / blocks, "kinds": kinds, "blocks": blocks}
    return {**values, "measured": out}


def check_tp_bytes(sent_fn: Callable, kept_fn: Callable, *, timeout: float = 20.0, runs_root: Any = None) -> Report:
    """Judge both functions on a GPT-3 layer and on 2 gloo ranks:  check_tp_bytes(tp_allreduce_bytes,
    kept_per_layer).ok."""
    names = [getattr(f, "__name__", d) for f, d in ((sent_fn, "tp_allreduce_bytes"), (kept_fn, "kept_per_layer"))]
    report = Report(f"{names[0]} and {names[1]}: TP's bytes per block, a GPT-3 layer and the tiny GPT-2 on "
                    f"{WORLD} gloo ranks", implementation=(sent_fn, kept_fn))
    outcomes = run_checked(report, functools.partial(_drive, sent_fn=sent_fn, kept_fn=kept_fn), world_size=WORLD,
                           timeout=timeout, name="check-tp-bytes", runs_root=runs_root,
                           hang_hint="Your functions compute numbers: they need no collective, and should not "
                                     "call one.")
    if outcomes is None:
        return report
    first = outcomes[0]
    report.measured["toy"] = {f"rank {rank}": out["measured"] for rank, out in enumerate(outcomes)}
    if judge_sent(report, first["sent_grid"], names[0]):
        _sent_toy(report, outcomes, names[0])
    if judge_kept(report, first["kept_grid"], names[1]):
        _kept_toy(report, outcomes, names[1])
    return report


def judge_sent(report: Report, got: list[Any], name: str) -> bool:
    """The all-reduce bytes on a GPT-3 layer at t = 1, 2, 8, 2- and 4-byte values (the learner's values in
    SENT_POINTS order)."""
    want = [_want_sent(t, vb) for t, vb in SENT_POINTS]
    report.measured["sent GPT-3"] = {f"t={t}, value_bytes={vb}": g for (t, vb), g in zip(SENT_POINTS, got)}
    return _judge(report, "all-reduce bytes", got, want, SENT_POINTS, _sent_slips(), name,
                  lambda t, vb: f"t={t}, value_bytes={vb}",
                  f"GPT-3's layer: at t=8 one rank sends {want[-2] / 2**20:.0f} MiB per block and step in bf16, "
                  "4 all-reduces x 2(t-1)/t x s·b·h x 2 bytes")


def judge_kept(report: Report, got: list[Any], name: str) -> bool:
    """The activation bytes on a GPT-3 layer at t = 1, 2, 8, without and with recomputation (in that order)."""
    points = [(t, r) for t in TPS for r in (False, True)]
    want = [_want_kept(t, r) for t, r in points]
    report.measured["kept GPT-3"] = {f"t={t}{' recompute' if r else ''}": g for (t, r), g in zip(points, got)}
    return _judge(report, "activation bytes", got, want, points, _kept_slips(), name,
                  lambda t, r: f"t={t}, recompute={r}",
                  f"GPT-3's layer: {want[0] / 2**30:.2f} GiB per sample at t=1, {want[-2] / 2**30:.2f} at t=8, "
                  f"{want[1] / 2**20:.0f} MiB recomputed: labkit.memory.activation_bytes")


def _judge(report: Report, check: str, got: list[Any], want: list[float], points: list[tuple], slips: dict,
           name: str, where: Callable, passed: str) -> bool:
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if not close(g, w)]
    if not wrong:
        report.add(check, "pass", passed)
        return True
    for why, slip in slips.items():
        if all(close(g, slip(*p)) for g, p in zip(got, points)):
            report.add(check, "fail", f"GPT-3's layer: {why}", part=name)
            return False
    i = wrong[0]
    said = next((why for why, slip in slips.items() if close(got[i], slip(*points[i]))), None)
    report.add(check, "fail", f"GPT-3's layer at {where(*points[i])}: your {said_number(got[i])} bytes, the formula's "
                              f"{want[i]:.6g} ({len(wrong)} of {len(points)} points wrong)"
                              + (f"; there it is {said}" if said else ""), part=name)
    return False


def _sent_toy(report: Report, outcomes: list[dict], name: str) -> None:
    out = outcomes[0]["measured"]["none"]
    ring = received_bytes({"all_reduce": out["handed"]}, WORLD)
    wire, how = (ring, "the ring model's for the bytes handed to them") if WIRE_UNMEASURED else \
        (max(o["measured"]["none"]["written"] for o in outcomes), "written to the sockets")
    got = outcomes[0]["sent_toy"]
    if out["kinds"] != {"all_reduce": 4 * out["blocks"]} or not close(ring, wire, WIRE_REL):
        raise AssertionError(f"labkit's own measurement: {out['kinds']}, {wire} B vs ring {ring}")
    if not close(got, wire, WIRE_REL):
        report.add("all-reduce bytes", "fail", f"the tiny GPT-2 on {WORLD} ranks, fp32 (value_bytes=4): your "
                                               f"{said_number(got)} bytes per block; each rank sent {wire:,.0f} ({how})",
                   part=name)
        return
    report.add("all-reduce bytes", "pass", f"the tiny GPT-2 on {WORLD} gloo ranks: 4 all-reduces per block, "
                                           f"{wire:,.0f} B per block {how}, your {float(got):,.0f} "
                                           f"({got / wire - 1:+.1%}: gloo's message headers)")


def _kept_toy(report: Report, outcomes: list[dict], name: str) -> None:
    for index, recompute in enumerate((False, True)):
        kept = max(o["measured"]["full" if recompute else "none"]["kept"] for o in outcomes)
        got = outcomes[0]["kept_toy"][index]
        way = "with recomputation" if recompute else "without recomputation"
        if not close(got, kept, TOY_REL):
            fix = ("" if recompute else " (the toy: whole=4, split=26, fp32, no dropout masks, no s x s scores)")
            report.add("activation bytes", "fail", f"the tiny GPT-2 on {WORLD} ranks {way}: your {said_number(got)} "
                                                   f"bytes per block, each rank kept {kept:,.0f}{fix}", part=name)
            return
        rest = "" if recompute else ": what the model leaves out, LayerNorm statistics and log-sum-exp"
        report.add("activation bytes", "pass", f"the tiny GPT-2 on {WORLD} gloo ranks {way}: each rank kept "
                                               f"{kept:,.0f} B per block, your {float(got):,.0f} "
                                               f"({got / kept - 1:+.2%}{rest})")
