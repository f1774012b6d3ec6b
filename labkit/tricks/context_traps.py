"""Context parallelism's traps, each run for real and caught (lesson 23):

    ct.wrong_merges(world=4)          # averaging the blocks, or masking every block: rank 0 exact, the others wrong
    ct.textbook_merge()               # weights exp(lse): right on paper, NaN once logits pass ~88 (exp overflows)
    ct.forgotten_position_ids()       # the loss moves a little, the logits a lot
    ct.ulysses_uneven_heads()         # gloo's all_to_all_single cuts through a head without a word
    ct.transposed_buffer()            # gloo refuses a transposed (non-contiguous) buffer

Each returns the numbers the ranks measured; the lesson turns them into claims. The lesson of all five: compare
every rank's logits and gradients with one process's, never rank 0's alone and never the loss alone.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from ..run import launch
from ..training.parallel import context as cp
from ..training.parallel import context_model as cm

SHAPE = (1, 2, 16, 8)   # batch, heads, sequence, head_dim


def _right(acc, new):
    return cp.merge(acc, new)


def _averaged(acc, new):
    """The wrong merge: the mean of the blocks' outputs, as if each block held an equal share of the softmax."""
    if acc is None or new is None:
        return acc or new
    return (acc[0] + new[0]) / 2, torch.logaddexp(acc[1], new[1])


def _textbook(acc, new):
    """Right on paper: weight each block by its exp-sum exp(lse). exp overflows float32 above about 88."""
    if acc is None or new is None:
        return acc or new
    wa, wb = acc[1].exp(), new[1].exp()
    return (wa * acc[0] + wb * new[0]) / (wa + wb), (wa + wb).log()


def _ring(q, k, v, pos, held, merge, mask_every_block=False):
    """Forward-only ring attention on this rank's rows: K/V passed on with isend/irecv, blocks merged by `merge`.
    mask_every_block: the mistake of applying the diagonal block's causal mask (by local index) to every block it
    does not skip (it still skips the later ranks' blocks, which the mask hides whole)."""
    n, me = dist.get_world_size(), dist.get_rank()
    acc, kv = None, torch.stack((k, v))
    for step in range(n):
        source = (me - step) % n
        if mask_every_block:
            acc = merge(acc, None if source > me else cp.block(q, kv[0], kv[1], pos, pos, True, None))
        else:
            acc = merge(acc, cp.block(q, kv[0], kv[1], pos, held[source], True, None))
        if step < n - 1:
            got = torch.empty_like(kv)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % n),
                                            dist.P2POp(dist.irecv, got, (me - 1) % n)])
            for work in works:
                work.wait()
            kv = got
    return acc[0]


def _merges_on_rank(ctx: Any) -> dict[str, float]:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*SHAPE, generator=gen) for _ in range(3))
    n = ctx.world_size
    held = [cp.positions(SHAPE[2], r, n) for r in range(n)]
    pos = held[ctx.rank]
    want = cp.reference(q, k, v).index_select(2, pos)
    mine = [t.index_select(2, pos) for t in (q, k, v)]
    out = {}
    for name, merge, masked in (("right", _right, False), ("averaged", _averaged, False),
                                ("masked every block", _right, True)):
        out[name] = (_ring(*mine, pos, held, merge, masked) - want).abs().max().item()
    return out


def wrong_merges(world: int = 4, runs_root: Any = None) -> dict[str, list[float]]:
    """Each rank's largest output error against one process, for the right merge and two wrong ones (contiguous
    split, causal): {"right": [...], "averaged": [...], "masked every block": [...]}, one number per rank."""
    run = launch(_merges_on_rank, world_size=world, timeout=60, echo=False, progress=False, runs_root=runs_root)
    results = [run.result(r) for r in range(world)]
    return {name: [got[name] for got in results] for name in results[0]}


def textbook_merge(scales: tuple[float, ...] = (1.0, 10.0, 100.0)) -> pd.DataFrame:
    """The sequence cut in two blocks (two ranks' keys) and merged both ways, at growing logits: one row per
    scale with the largest logit and each merge's error against one process's attention. Pure arithmetic: the
    merge is the same on one process as on two ranks, so no ranks are started."""
    rows = []
    for scale in scales:
        gen = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(*SHAPE, generator=gen) for _ in range(3))
        q, k = q * math.sqrt(scale), k * math.sqrt(scale)
        pos = torch.arange(SHAPE[2])
        half = SHAPE[2] // 2
        blocks = [cp.block(q, k[:, :, s], v[:, :, s], pos, pos[s], False, None)
                  for s in (slice(0, half), slice(half, None))]
        want = cp.reference(q, k, v, causal=False)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(SHAPE[3])).abs().max().item()
        textbook = _textbook(blocks[0], blocks[1])[0]
        right = cp.merge(blocks[0], blocks[1])[0]
        rows.append({"scale": scale, "max_logit": logits,
                     "textbook_error": (textbook - want).abs().max().item(),
                     "logaddexp_error": (right - want).abs().max().item(),
                     "textbook_finite": bool(torch.isfinite(textbook).all())})
    return pd.DataFrame(rows)


def _positions_on_rank(ctx: Any) -> dict[str, float]:
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(64, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    one = build()
    with torch.no_grad():
        want = one(input_ids=inputs).logits
    model = build()
    cm.split_attention(model, split="contiguous")
    mine, labels, position_ids = cm.sequence_share(inputs, targets, ctx.rank, ctx.world_size, "contiguous")
    pos = position_ids[0]
    out = {}
    with torch.no_grad():
        for name, kwargs in (("with", {"position_ids": position_ids}), ("without", {})):
            logits = model(input_ids=mine, **kwargs).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))
            dist.all_reduce(loss)   # the mean over ranks: the whole sequence's loss (equal shares)
            out[f"{name}_loss"] = loss.item() / ctx.world_size
            out[f"{name}_logits_gap"] = (logits - want[:, pos]).abs().max().item()
    out["one_loss"] = torch.nn.functional.cross_entropy(want.reshape(-1, 64), targets.reshape(-1)).item()
    out["logits_scale"] = want.abs().max().item()
    return out


def forgotten_position_ids(world: int = 2, runs_root: Any = None) -> dict[str, float]:
    """A tiny GPT-2 split over `world` ranks, its forward run with and without position_ids:
    {"loss_gap": |loss without - one process's|, "logits_gap": largest logit error without them over all ranks,
    "with_ids_logits_gap": the same with them, "loss": one process's loss, "logits_scale": its largest |logit|,
    "loss_rel" and "logits_rel": each gap relative to its own scale, so that the two compare}."""
    run = launch(_positions_on_rank, world_size=world, timeout=60, echo=False, progress=False, runs_root=runs_root)
    got = [run.result(r) for r in range(world)]
    out = {"loss_gap": abs(got[0]["without_loss"] - got[0]["one_loss"]),
           "logits_gap": max(g["without_logits_gap"] for g in got),
           "with_ids_logits_gap": max(g["with_logits_gap"] for g in got),
           "loss": got[0]["one_loss"], "logits_scale": got[0]["logits_scale"]}
    return {**out, "loss_rel": out["loss_gap"] / out["loss"], "logits_rel": out["logits_gap"] / out["logits_scale"]}


def _heads_on_rank(ctx: Any) -> dict[str, Any]:
    heads, local, dim = 3, 4, 2
    # Rows [head, position] of this rank's q, tagged so that the receiver can tell which head each row was
    q = torch.arange(heads).repeat_interleave(local)[:, None].float().expand(-1, dim).contiguous()
    got = torch.empty_like(q)
    dist.all_to_all_single(got, q)   # gloo splits dim 0 into world_size equal parts: 12 rows, 6 each
    refused = ""
    try:
        cp.attention(torch.zeros(1, heads, local, dim), torch.zeros(1, heads, local, dim),
                     torch.zeros(1, heads, local, dim), cp.positions(local * ctx.world_size, ctx.rank, ctx.world_size),
                     method="ulysses")
    except ValueError as error:
        refused = str(error)
    return {"heads_received": sorted({int(h) for h in got[:, 0].tolist()}), "rows": got.shape[0], "refused": refused}


def ulysses_uneven_heads(runs_root: Any = None) -> dict[str, Any]:
    """3 heads over 2 ranks through gloo's all_to_all_single: {"gloo_raised": False, "cut_heads": heads whose rows
    landed on both ranks, "received": each rank's heads, "refused": labkit's message for the same request}."""
    try:
        run = launch(_heads_on_rank, world_size=2, timeout=60, echo=False, progress=False, runs_root=runs_root)
    except Exception as error:   # noqa: BLE001 - a refusal by gloo would be the other possible answer
        return {"gloo_raised": True, "cut_heads": 0, "received": [], "refused": str(error)}
    got = [run.result(r) for r in range(2)]
    received = [g["heads_received"] for g in got]
    return {"gloo_raised": False, "cut_heads": len(set(received[0]) & set(received[1])), "received": received,
            "refused": got[0]["refused"]}


def _transposed_on_rank(ctx: Any) -> str:
    buffer = torch.arange(24.0).reshape(4, 6).t()   # a transposed view: not contiguous in memory
    try:
        dist.all_to_all_single(torch.empty(6, 4), buffer)
    except (ValueError, RuntimeError) as error:
        message = f"{type(error).__name__}: {error}"
    else:
        message = ""
    dist.all_to_all_single(torch.empty(6, 4), buffer.contiguous())   # the fix: one copy, and gloo takes it
    return message


def transposed_buffer(runs_root: Any = None) -> dict[str, str]:
    """A transposed tensor handed to all_to_all_single on 2 gloo ranks: {"error": what gloo said ("" if nothing)};
    the same tensor made contiguous then goes through."""
    run = launch(_transposed_on_rank, world_size=2, timeout=60, echo=False, progress=False, runs_root=runs_root)
    return {"error": run.result(0)}
