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

What is checked, on 2 and 4 ranks, causal, each rank against one process's attention (forward and q/k/v gradients),
on contiguous and zigzag splits, a non-causal probe and logits of a few thousand; each failure names your function
and which step of it is wrong, from what the Ring saw it do (the checker knows every rank's K and V):
    runs        every rank finished; a hang names each rank's line in your code (a shift not every rank made)
    ring.block  its q, k and v are this rank's queries and one rank's K and V (not a V as K, not K and V of two
                ranks), and `source` names the rank whose K and V they are (the causal mask is placed by it)
    the shift   every rank's K and V reach ring.block once, the output uses what every shift returned (else its
                backward would hang: checked before backward, so no hang), and no more than size - 1 shifts' worth
                of K and V is sent
    the merge   with every block right, the output equals one process's attention: several blocks merged wrong
                (one block right), overflow at large logits (exp(lse) formed), a constant added after the merge
    backward    with the output right, q's, K's and V's gradients equal one process's
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..training.parallel import context as cp
from .learner import learner_part, run_checked
from .report import Report

TOLERANCE = 1e-4            # float32, the largest output or gradient difference allowed (a right merge: about 1e-6)
SHAPE = (1, 2, 16, 8)       # batch, heads, sequence, head_dim
LARGE = 60.0                # q and k scaled so that logits reach a few thousand
# A hang in forward: a shift one rank made and another did not. (The other hang, a shift whose output a rank never
# used, is found before backward runs: see drive_ring.)
SHIFT_HANG = "In ring attention every rank must call ring.shift the same number of times, in the same order."


@dataclasses.dataclass
class Ring:
    """What a learner's ring attention may use on its rank (see the module docstring). The checker's Ring also
    writes down what it was given: whose K and V reached each block, each shift's bytes and output."""
    rank: int
    size: int
    pos: torch.Tensor
    split: str
    causal: bool
    stats: cp.Traffic
    owners: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor] | None = None   # every rank's K, V; my q
    blocks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    shifted: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def block(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: int):
        """(out, lse) of this rank's queries over rank `source`'s keys, or None if the causal mask hides all."""
        k_pos = cp.positions(self.pos.numel() * self.size, source, self.size, self.split)
        got = cp.block(q, k, v, self.pos, k_pos, self.causal, self.stats)
        if self.owners is not None:
            keys, values, mine = self.owners
            self.blocks.append({"source": int(source), "k": _whose(k, keys, values), "v": _whose(v, values, keys),
                                "q": _same(q, mine), "hidden": got is None})
        return got

    def shift(self, t: torch.Tensor) -> torch.Tensor:
        """Send t to rank (rank + 1) % size; return what rank (rank - 1) % size sent (differentiable)."""
        out = cp._Shift.apply(t, list(range(self.size)), self.rank, self.stats)
        self.shifted.append(out)
        return out


def _same(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a.detach(), b)


def _whose(t: Any, mine: list[torch.Tensor], other: list[torch.Tensor]) -> tuple[str, int]:
    """("own", r) if t is rank r's tensor of its kind, ("other", r) if rank r's of the other kind (a V given as K),
    ("none", -1) if no rank's."""
    for kind, tensors in (("own", mine), ("other", other)):
        for r, x in enumerate(tensors):
            if _same(t, x):
                return kind, r
    return "none", -1


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


def _reachable(out: torch.Tensor) -> set[int]:
    """The ids of the autograd nodes `out` depends on."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo += [n for n, _ in node.next_functions]
    return seen


def _constant(diff: torch.Tensor) -> bool:
    """Whether a difference is the same number everywhere (to float32's rounding of that number)."""
    return diff.std().item() <= max(TOLERANCE / 10, 1e-5 * diff.mean().abs().item())


def drive_ring(ctx: Any, attention: Callable, name: str = "ring attention") -> dict[str, Any]:
    """On each rank, each probe: the learner's attention on this rank's rows, against one process's, and what the
    Ring saw it do. Backward runs only when every rank's output uses every shift it made (else it would hang)."""
    out = {"rank": ctx.rank}
    for probe, (split, causal, scale) in PROBES.items():
        gen = torch.Generator().manual_seed(7)
        full = [torch.randn(*SHAPE, generator=gen) for _ in range(4)]
        full[0], full[1] = full[0] * scale, full[1] * scale
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        cp.reference(*leaves, causal=causal).backward(full[3])
        pos = cp.positions(SHAPE[2], ctx.rank, ctx.world_size, split)
        mine = [t.index_select(2, pos).requires_grad_() for t in full[:3]]
        every = [cp.positions(SHAPE[2], r, ctx.world_size, split) for r in range(ctx.world_size)]
        owners = ([full[1].index_select(2, p) for p in every], [full[2].index_select(2, p) for p in every],
                  full[0].index_select(2, pos))
        ring = Ring(ctx.rank, ctx.world_size, pos, split, causal, cp.Traffic(), owners)
        want = cp.reference(*full[:3], causal=causal).index_select(2, pos)
        with learner_part(ctx, name):
            got = attention(*mine, ring)
        facts = {"blocks": ring.blocks, "shifts": len(ring.shifted), "bytes": ring.stats.bytes_sent,
                 "needed": [r for r, p in enumerate(every) if not causal or bool((pos[:, None] >= p[None, :]).any())],
                 "kv_bytes": 2 * owners[0][0].numel() * owners[0][0].element_size()}
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            facts["shape"] = str(tuple(got.shape)) if isinstance(got, torch.Tensor) else type(got).__name__
        elif not got.requires_grad:
            facts["no_grad"] = True
        else:
            reached = _reachable(got)
            facts["untied"] = [i for i, t in enumerate(ring.shifted) if id(t.grad_fn) not in reached]
        stop = torch.tensor(float(bool(facts.get("shape") or facts.get("no_grad") or facts.get("untied"))))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)     # a backward one rank skips would hang the others
        if stop.item() == 0:
            with learner_part(ctx, name):
                got.backward(full[3].index_select(2, pos))
            diff = (got - want).detach()
            errors = [diff.abs().max().item()]
            errors += [(a.grad - b.grad.index_select(2, pos)).abs().max().item() if a.grad is not None
                       else math.inf for a, b in zip(mine, leaves)]
            finite = bool(torch.isfinite(got).all()) and all(math.isfinite(e) for e in errors)
            facts.update(error=max(errors) if finite else math.inf, finite=finite, errors=errors,
                         offset=diff.mean().item() if finite and _constant(diff) else 0.0)
        else:
            facts.update(error=math.inf, finite=True, errors=[math.inf] * 4, offset=0.0, skipped=True)
        out[probe] = facts
    return out


def check_ring(attention: Callable, *, worlds: tuple[int, ...] = (2, 4), timeout: float = 30.0,
               runs_root: Any = None) -> Report:
    """Run `attention(q, k, v, ring)` on each world size of `worlds` and report what is right and wrong with it:
    check_ring(ring_attention).ok."""
    name = getattr(attention, "__name__", repr(attention))
    report = Report(f"{name}: ring attention on {' and '.join(map(str, worlds))} gloo ranks", implementation=attention)
    results = {}
    for world in worlds:
        got = run_checked(report, functools.partial(drive_ring, attention=attention, name=name), world_size=world,
                          timeout=timeout, name=f"check-{name}-w{world}", runs_root=runs_root, hang_hint=SHIFT_HANG)
        if got is None:
            last = report.findings[-1]
            if last.status == "fail" and not last.part:   # no rank stood in a line of yours: still, yours hung
                report.findings[-1] = dataclasses.replace(last, part=name)
            return report
        results[world] = got
    report.add("runs", "pass", f"every rank finished on {' and '.join(map(str, worlds))} ranks")
    cases = {(w, r["rank"], p): r[p] for w, got in results.items() for r in got for p in PROBES}
    if _check_steps(report, cases, name):
        return report
    worst = {key: facts["error"] for key, facts in cases.items()}
    report.measured["worst_error"] = max(worst.values())
    wrong = {key for key, error in worst.items() if not error <= TOLERANCE}
    if not wrong:
        report.add("outputs and gradients", "pass", f"every rank, every probe, within {TOLERANCE:g} of one process "
                   f"(largest difference {report.measured['worst_error']:.1e})")
        return report
    check, message = explain(wrong, cases)
    report.add(check, "fail", message, part=name)
    return report


def _where(key: tuple[int, int, str]) -> str:
    world, rank, probe = key
    return f"on rank {rank} of {world} ({probe} probe)"


def _check_steps(report: Report, cases: dict[tuple[int, int, str], dict[str, Any]], name: str) -> bool:
    """What the Ring saw: the blocks' inputs, every rank's K and V used once, every shift used, the traffic. Adds
    a failure per step that went wrong (its first case) and returns True if any did: then the output's difference
    from one process's says nothing about the merge."""
    found: dict[str, str] = {}

    def fail(check: str, message: str) -> None:
        found.setdefault(check, message)

    for key, facts in sorted(cases.items()):
        where = _where(key)
        for i, b in enumerate(facts["blocks"]):
            call = f"{where}, ring.block call #{i + 1}"
            if not b["q"]:
                fail("ring.block", f"{call} was not given this rank's q: pass your q, unchanged, to every block")
            for t, kind, other in (("k", "K", "V"), ("v", "V", "K")):
                got, r = b[t]
                if got == "other":
                    fail("ring.block", f"{call}: the {kind} you passed is rank {r}'s {other}: block(q, k, v, "
                                       f"source) takes K then V")
                elif got == "none":
                    fail("ring.block", f"{call}: the {kind} you passed is no rank's {kind}: what reaches "
                                       "ring.block must be K and V as a rank holds them or ring.shift handed them on")
            if b["k"][0] == b["v"][0] == "own" and b["k"][1] != b["v"][1]:
                fail("ring.block", f"{call}: K of rank {b['k'][1]} with V of rank {b['v'][1]}: shift K and V "
                                   "together, so that a block gets one rank's pair")
            if b["k"][0] == "own" and b["k"][1] == b["v"][1] and b["source"] != b["k"][1]:
                fail("block source", f"{call}: told source = {b['source']}, but the K and V you passed are rank "
                                     f"{b['k'][1]}'s. The causal mask is placed by the source's positions: after "
                                     "`step` shifts a rank holds rank (rank - step) % size's K and V")
        used = [b["k"][1] for b in facts["blocks"] if b["k"][0] == "own" and b["k"][1] == b["v"][1]]
        missing = [r for r in range(key[0]) if r not in used]
        twice = sorted({r for r in used if used.count(r) > 1})
        paired = len(used) == len(facts["blocks"])   # else ring.block's inputs are wrong, said above
        if paired and (set(missing) & set(facts["needed"]) or twice):   # a block the mask hides may be left out
            fail("the shift", f"{where} your blocks used the K and V of ranks {used} (in that order; "
                 f"{facts['shifts']} calls of ring.shift): "
                 + (f"rank(s) {missing}'s never reached ring.block" if missing else "")
                 + ("; " if missing and twice else "") + (f"rank(s) {twice}'s more than once" if twice else "")
                 + ". Every rank's K and V must reach ring.block once: size blocks, a shift between each two, each "
                   "block on what the last shift returned")
        if facts.get("shape"):
            fail("output", f"{where} your function returned {facts['shape']}, not this rank's rows of the output "
                           f"{SHAPE[:2] + (SHAPE[2] // key[0], SHAPE[3])}")
        if facts.get("no_grad"):
            fail("backward", f"{where} your output does not require grad: it was cut off from autograd, so no "
                             "gradient can reach q, K and V. Build it from the blocks' tensors")
        if facts.get("untied"):
            last_hidden = bool(facts["blocks"]) and facts["blocks"][-1]["hidden"]
            fail("the shift", f"{where} your output does not use what ring.shift returned at call(s) "
                 f"#{', #'.join(str(i + 1) for i in facts['untied'])}"
                 + (" (your last ring.block gave None: the causal mask hides it whole)" if last_hidden else "")
                 + ": that shift's backward would never run on this rank, and the ranks that used theirs would "
                   "wait for its gradient forever, a hang (backward was not run). Tie them into the output "
                   "(out + 0 * kv.sum()), or do not shift after the last block")
        extra = facts["bytes"] - (key[0] - 1) * facts["kv_bytes"]
        if extra > 0:
            fail("traffic", f"{where} your shifts sent {facts['bytes']} bytes in forward, {extra} more than size - 1 "
                            f"= {key[0] - 1} shifts of this rank's K and V: after size - 1 shifts every rank has "
                            "seen every block (the next brings its own back), and each extra shift costs a K and V's "
                            "traffic in forward and again in backward")
    for check in sorted(found, key=lambda c: c != "the shift"):   # no shift also shows as a wrong source
        report.add(check, "fail", found[check], part=name)
    return bool(found)


def explain(wrong: set[tuple[int, int, str]], cases: dict[tuple[int, int, str], dict[str, Any]]) -> tuple[str, str]:
    """(the step, the cause) that the wrong (world, rank, probe) cases point to, every block having been right."""
    first = min(wrong)
    outputs = {key for key in wrong if not cases[key]["errors"][0] <= TOLERANCE}
    if not outputs:
        names = [n for n, e in zip(("q", "K", "V"), cases[first]["errors"][1:]) if not e <= TOLERANCE]
        return "backward", (f"your output is right on every rank and probe, but the gradient of "
                            f"{' and '.join(names)} differs from one process's {_where(first)} (by "
                            f"{max(cases[first]['errors'][1:]):.3g}): build the output from the blocks' tensors "
                            "by differentiable operations, so that autograd carries the gradient back round the ring")
    first = min(outputs)
    if {p for _, _, p in outputs} == {"large logits"}:
        return "the merge", ("right at ordinary logits, wrong at logits of a few thousand"
                             + (" (NaN or inf)" if any(not cases[key]["finite"] for key in outputs) else "")
                             + ": your merge forms exp(lse) of each block, which overflows; weight each block by "
                             "exp(lse_i - lse) with lse = logaddexp(lse_a, lse_b)")
    offsets = {round(cases[key]["offset"], 4) for key in outputs}
    if all(abs(cases[key]["offset"]) > TOLERANCE for key in outputs):
        return "output", (f"every block was right, and your output is one process's attention plus a constant "
                          f"({', '.join(f'{o:g}' for o in sorted(offsets)[:3])}) {_where(first)}: something is "
                          "added after the merge (a tie into the graph must add 0, as 0 * kv.sum() does)")
    shown = lambda key: sum(not b["hidden"] for b in cases[key]["blocks"])
    single = [key for key in cases if shown(key) == 1]
    if single and not any(key in outputs for key in single) and all(shown(key) > 1 for key in outputs):
        return "the merge", (f"every block was right; your output is right where a rank's queries see one block "
                             f"only (e.g. {_where(single[0])[3:]}) and wrong where several are merged (e.g. "
                             f"{_where(first)[3:]}): the merge of two blocks is wrong. Each block must be weighted "
                             "by exp(lse_i - lse), its share of the whole softmax, with lse = logaddexp(lse_a, lse_b)")
    return "the merge", (f"every block was right (every rank's K and V, once, with its owner), but your output "
                         f"differs from one process's attention {_where(first)} (by "
                         f"{cases[first]['errors'][0]:.3g}): what you made of the blocks, the merge or what you "
                         "return after it, is wrong")
