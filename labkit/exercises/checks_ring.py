"""Build ring attention yourself: the loop over the ring and the online-softmax merge, checked on 2 and 4 gloo ranks.

    def my_ring(q, k, v, ring):            # q, k, v: this rank's rows, [batch, heads, local, head_dim]
        ...                                # ring.rank, ring.size, ring.block(q, k, v, source), ring.shift(kv)
    report = check_ring(my_ring)           # every rank's output and gradients against one process's attention
    my_ring = report.use(ring_attention)   # yours if it passed

What `ring` gives (a Ring): `ring.block(q, k, v, source)` is the attention of this rank's queries over the keys that
rank `source` holds, as (out, lse), or None when the causal mask hides that block entirely; `ring.shift(t)` sends t
to the next rank and returns the previous rank's (autograd sends the gradient back round the ring, so backward is
yours for free); `ring.rank` and `ring.size`. After `step` shifts a rank holds the K and V of rank (rank - step) % size.
Your function returns this rank's rows of the output.

What is checked, on 2 and 4 ranks, causal, each rank against one process's attention (forward and q/k/v gradients):
    runs        every rank finished (a shift that not every rank makes hangs, and so does a shift whose output
                a rank never used: its backward never runs there; reported, bounded by a timeout, with that cause)
    probes      contiguous and zigzag splits; a non-causal probe; logits of a few thousand
    mistakes    told apart from what each rank got: rank 0's output right and the others' wrong under the
                contiguous split (rank 0 uses its own block only, so the merge of several blocks is wrong);
                right without a mask and wrong with one (the keys' owner given to ring.block is not the rank
                whose K and V this rank holds now: the mask is placed by their positions); NaN or inf only at
                large logits (the textbook merge: exp(lse) overflows)
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..training.parallel import context as cp
from .learner import learner_part, run_checked
from .report import Report

TOLERANCE = 1e-4            # float32, the largest output or gradient difference allowed (a right merge: about 1e-6)
SHAPE = (1, 2, 16, 8)       # batch, heads, sequence, head_dim
LARGE = 60.0                # q and k scaled so that logits reach a few thousand
# A natural loop's hang: under the causal mask a rank's last block can be hidden whole (ring.block gives None), so
# the K and V of the last shift never reach its output; autograd then never runs that shift's backward there, while
# the ranks that used theirs wait for its gradient.
LAST_SHIFT = ("In ring attention the likeliest cause: a rank whose last block the mask hides (ring.block gave None) "
              "never used the last shift's K and V, so its backward never sends their gradient to the ranks waiting "
              "for it. Tie them into the output (out + 0 * kv.sum()), or do not shift after the last block.")


@dataclasses.dataclass
class Ring:
    """What a learner's ring attention may use on its rank (see the module docstring)."""
    rank: int
    size: int
    pos: torch.Tensor
    split: str
    causal: bool
    stats: cp.Traffic

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: int):
        """(out, lse) of this rank's queries over rank `source`'s keys, or None if the causal mask hides all."""
        k_pos = cp.positions(self.pos.numel() * self.size, source, self.size, self.split)
        return cp.block(q, k, v, self.pos, k_pos, self.causal, self.stats)

    def shift(self, t: torch.Tensor) -> torch.Tensor:
        """Send t to rank (rank + 1) % size; return what rank (rank - 1) % size sent (differentiable)."""
        return cp._Shift.apply(t, list(range(self.size)), self.rank, self.stats)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """The reference: K and V round the ring, each block merged into the running one by its log-sum-exp."""
    acc, kv, last = None, torch.stack((k, v)), None
    for step in range(ring.size):
        last = ring.block(q, kv[0], kv[1], (ring.rank - step) % ring.size)
        acc = cp.merge(acc, last)
        if step < ring.size - 1:
            kv = ring.shift(kv)
    out = acc[0]
    return out if last is not None else out + 0 * kv.sum()   # every rank runs every shift's backward


PROBES = {"contiguous": ("contiguous", True, 1.0), "zigzag": ("zigzag", True, 1.0),
          "no mask": ("contiguous", False, 1.0), "large logits": ("contiguous", True, LARGE)}


def drive_ring(ctx: Any, attention: Callable) -> dict[str, Any]:
    """On each rank, each probe: the learner's attention on this rank's rows, against one process's."""
    out = {"rank": ctx.rank}
    for probe, (split, causal, scale) in PROBES.items():
        gen = torch.Generator().manual_seed(7)
        full = [torch.randn(*SHAPE, generator=gen) for _ in range(4)]
        full[0], full[1] = full[0] * scale, full[1] * scale
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        cp.reference(*leaves, causal=causal).backward(full[3])
        pos = cp.positions(SHAPE[2], ctx.rank, ctx.world_size, split)
        mine = [t.index_select(2, pos).requires_grad_() for t in full[:3]]
        ring = Ring(ctx.rank, ctx.world_size, pos, split, causal, cp.Traffic())
        with learner_part(ctx, "ring attention"):
            got = attention(*mine, ring)
            got.backward(full[3].index_select(2, pos))
        want = cp.reference(*full[:3], causal=causal).index_select(2, pos)
        errors = [(got - want).abs().max().item()]
        errors += [(a.grad - b.grad.index_select(2, pos)).abs().max().item() if a.grad is not None else math.inf
                   for a, b in zip(mine, leaves)]
        finite = bool(torch.isfinite(got).all()) and all(math.isfinite(e) for e in errors)
        out[probe] = {"error": max(errors) if finite else math.inf, "finite": finite,
                      "output error": errors[0] if finite else math.inf}
    return out


def check_ring(attention: Callable, *, worlds: tuple[int, ...] = (2, 4), timeout: float = 30.0,
               runs_root: Any = None) -> Report:
    """Run `attention(q, k, v, ring)` on each world size of `worlds` and report what is right and wrong with it:
    check_ring(ring_attention).ok."""
    name = getattr(attention, "__name__", repr(attention))
    report = Report(f"{name}: ring attention on {' and '.join(map(str, worlds))} gloo ranks", implementation=attention)
    results = {}
    for world in worlds:
        got = run_checked(report, functools.partial(drive_ring, attention=attention), world_size=world,
                          timeout=timeout, name=f"check-{name}-w{world}", runs_root=runs_root,
                          hang_hint=LAST_SHIFT)
        if got is None:
            return report
        results[world] = got
    report.add("runs", "pass", f"every rank finished on {' and '.join(map(str, worlds))} ranks")
    worst = {(w, r["rank"], p): r[p]["error"] for w, got in results.items() for r in got for p in PROBES}
    report.measured["worst_error"] = max(worst.values())
    wrong = {key for key, error in worst.items() if not error <= TOLERANCE}
    if not wrong:
        report.add("outputs and gradients", "pass", f"every rank, every probe, within {TOLERANCE:g} of one process "
                   f"(largest difference {report.measured['worst_error']:.1e})")
        return report
    report.add("outputs and gradients", "fail", explain(wrong, results))
    return report


def explain(wrong: set[tuple[int, int, str]], results: dict[int, list[dict[str, Any]]]) -> str:
    """Name the classic mistake the wrong (world, rank, probe) cases point to."""
    probes = {p for _, _, p in wrong}
    ranks = {r for _, r, _ in wrong}
    if probes == {"large logits"}:
        return ("right at ordinary logits, wrong at logits of a few thousand"
                + (" (NaN or inf)" if any(not results[w][r][p]["finite"] for w, r, p in wrong) else "")
                + ": your merge forms exp(lse) of each block, which overflows; weight each block by "
                "exp(lse_i - lse) with lse = logaddexp(lse_a, lse_b)")
    if "no mask" not in probes and probes & {"contiguous", "zigzag"}:
        return ("right without a causal mask, wrong with one: the mask is placed by the keys' positions, so "
                "ring.block must be told whose K and V this rank holds now: after `step` shifts, rank "
                "(rank - step) % size's")
    # Rank 0's own output: under the contiguous split its queries see its own block only (its K/V gradients come
    # from the other ranks' queries, so they show the others' mistakes too).
    outputs = {r for w, got in results.items() for r in range(w)
               if not got[r]["contiguous"]["output error"] <= TOLERANCE}
    if outputs and 0 not in outputs:
        return ("rank 0's output is right and the other ranks' are wrong: rank 0 only ever uses its own block, so "
                "the merge of several blocks is what is wrong (averaging the outputs? each block must be weighted by "
                "exp(lse_i - lse), its share of the whole softmax)")
    cases = ", ".join(f"{p} on rank {r} of {w}" for w, r, p in sorted(wrong)[:4])
    return f"outputs or gradients differ from one process's attention ({cases})"
