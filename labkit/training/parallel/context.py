"""Context parallelism: one sequence split across ranks, attention computed over the whole of it three ways.

    pos = positions(seq_len, rank, world, split="zigzag")        # the global positions this rank holds
    q, k, v = (t.index_select(2, pos) for t in (q_full, k_full, v_full))      # [batch, heads, local, head_dim]
    stats = Traffic()
    out = attention(q, k, v, pos, method="ring", split="zigzag", stats=stats)   # this rank's rows of the output
    stats.bytes_sent, stats.pairs                                            # what it sent, what it computed

Every rank must call with the same method, split and shapes. Gradients flow through all three (autograd):
- ring: K and V travel round the ring, one block per step (torch's P2P ops through a differentiable shift whose
  backward sends the gradient the other way round); each block's output is merged into the running one by its
  log-sum-exp. A rank sends 2(N-1) K/V blocks forward. What the causal mask hides is left out: every pair of
  position runs it hides whole (skip="chunks"), or only whole blocks (skip="blocks", the slower way, for lessons).
- allgather: K and V gathered whole (backward: reduce-scatter), every rank attends to all of it.
- ulysses: an all-to-all turns sequence shards into head shards (each rank gets every position of H/N heads), plain
  attention runs there, and a second all-to-all turns the output back; q, k, v and out each send (N-1)/N of
  themselves. Needs heads divisible by N.

Splits: "contiguous" gives rank r the r-th slice, which under a causal mask leaves the last rank most of the (query,
key) pairs; "zigzag" gives rank r chunks r and 2N-1-r of 2N, which evens the pairs out exactly (and the work, when
the hidden chunk pairs are left out: no zigzag block is hidden whole at 2 ranks).
torch 2.13's own context_parallel() does not run causal attention on CPU (no sharding rule for the CPU flash op),
hence these; they are written to be read, not to be fast.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

METHODS = ("ring", "allgather", "ulysses")
SPLITS = ("contiguous", "zigzag")
SKIPS = ("chunks", "blocks")   # what the causal mask lets a rank leave out: see block()
MASKED = -1e30   # the log-weight of rows that see nothing in a block: finite, so that merges give no NaN


@dataclasses.dataclass
class Traffic:
    """What one rank did for attention in forward: bytes it sent, (query, key) pairs the mask let it see, scores it
    computed (those pairs and the masked ones computed beside them: the work), blocks it skipped whole.
    (Backward sends as much again, the gradients of what forward sent, the other way.)"""
    bytes_sent: int = 0
    pairs: int = 0
    scores: int = 0
    blocks_skipped: int = 0


def positions(seq_len: int, rank: int, world: int, split: str = "contiguous") -> torch.Tensor:
    """The global positions rank `rank` of `world` holds:  positions(8, 0, 2, "zigzag") -> tensor([0, 1, 6, 7])."""
    if split not in SPLITS:
        raise ValueError(f"split = {split!r}: must be one of {SPLITS}")
    parts = world * (2 if split == "zigzag" else 1)
    if seq_len % parts:
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split {split} over {world} ranks: it must be "
                         f"divisible by {parts}" + (" (2 x ranks, for zigzag)" if split == "zigzag" else ""))
    size = seq_len // parts
    chunks = [rank] if split == "contiguous" else [rank, parts - 1 - rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def causal_pairs(seq_len: int, world: int, split: str) -> list[int]:
    """(query, key) pairs each rank's queries see under a causal mask:  causal_pairs(8, 2, "contiguous") -> [10, 26]."""
    out = []
    for rank in range(world):
        pos = positions(seq_len, rank, world, split)
        out.append(int((pos + 1).sum()))   # query at position p sees keys 0..p
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """One process's attention over the whole sequence, [batch, heads, seq, head_dim]: what every method must equal."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def block(q, k, v, q_pos, k_pos, causal, stats: Traffic | None, skip: str = "chunks", chunk: int = 0):
    """One block of attention: (out, lse) of q against k/v, or None when the causal mask hides the whole block.

    skip="chunks" cuts q and k into runs of consecutive positions, also at every multiple of `chunk` (attention
    passes the zigzag chunk, seq_len / 2N, for both splits), and leaves out every (query run, key run) pair the mask
    hides whole; skip="blocks" leaves out hidden blocks only, and computes a partly hidden block whole under its
    mask. At 2 ranks no zigzag block is hidden whole: skipping blocks only, zigzag's even share of pairs is not an
    even share of work."""
    if skip not in SKIPS:
        raise ValueError(f"skip = {skip!r}: must be one of {SKIPS}")
    if causal and not bool((q_pos[:, None] >= k_pos[None, :]).any()):
        if stats is not None:
            stats.blocks_skipped += 1
        return None
    if not causal or skip == "blocks":
        return _dense(q, k, v, q_pos, k_pos, causal, stats)
    rows = []
    for qs in _runs(q_pos, chunk):
        acc = None
        for ks in _runs(k_pos, chunk):
            if int(q_pos[qs.stop - 1]) >= int(k_pos[ks.start]):      # the run's last query sees the run's first key
                acc = merge(acc, _dense(q[..., qs, :], k[..., ks, :], v[..., ks, :], q_pos[qs], k_pos[ks], True,
                                        stats))
        if acc is None:   # these queries see nothing here: no output, and a weight of exp(MASKED) = 0 in merges
            rows_here = qs.stop - qs.start
            acc = q.new_zeros(*q.shape[:-2], rows_here, v.shape[-1]), q.new_full((*q.shape[:-2], rows_here, 1), MASKED)
        rows.append(acc)
    if len(rows) == 1:
        return rows[0]
    return torch.cat([r[0] for r in rows], -2), torch.cat([r[1] for r in rows], -2)


def _runs(pos: torch.Tensor, chunk: int = 0) -> list[slice]:
    """The runs of consecutive positions in `pos`, cut also where a position is a multiple of `chunk` (0: nowhere):
    _runs(tensor([0, 1, 6, 7])) -> [slice(0, 2), slice(2, 4)];  _runs(arange(4), 2) -> [slice(0, 2), slice(2, 4)]."""
    starts = pos[1:] != pos[:-1] + 1
    if chunk:
        starts |= pos[1:] % chunk == 0
    cuts = [0] + [i + 1 for i in torch.nonzero(starts).flatten().tolist()] + [pos.numel()]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def _dense(q, k, v, q_pos, k_pos, causal, stats: Traffic | None):
    """(out, lse) of q against all of k/v, the causal mask applied where it hides part of the block."""
    visible = q_pos[:, None] >= k_pos[None, :] if causal else None
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    empty = None
    if visible is not None and not bool(visible.all()):
        # Hidden scores are -inf: exp(-inf) is fast, while exp of a finite score far below -87 (it underflows) takes
        # CPU's slow path, 7-20x slower. A row that sees nothing here (a partly hidden block under skip="blocks")
        # keeps finite scores instead (-inf everywhere would give NaN, in backward too); its output is zeroed.
        empty = ~visible.any(-1, keepdim=True)
        scores = scores.masked_fill(~visible & ~empty, float("-inf"))
    if stats is not None:
        per_head = int(visible.sum()) if visible is not None else q.shape[-2] * k.shape[-2]
        stats.pairs += per_head * q.shape[0] * q.shape[1]
        stats.scores += q.shape[-2] * k.shape[-2] * q.shape[0] * q.shape[1]
    lse = scores.logsumexp(-1, keepdim=True)
    out = (scores - lse).exp() @ v
    if empty is not None and bool(empty.any()):
        out, lse = out.masked_fill(empty, 0.0), lse.masked_fill(empty, MASKED)
    return out, lse


def merge(acc, new):
    """Two partial attentions over disjoint keys, as one: each weighted by its share of the total exp-sum,
    exp(lse_i - lse), computed without ever forming exp(lse_i) (which overflows once scores reach a few hundred)."""
    if acc is None:
        return new
    if new is None:
        return acc
    (out_a, lse_a), (out_b, lse_b) = acc, new
    lse = torch.logaddexp(lse_a, lse_b)
    return (lse_a - lse).exp() * out_a + (lse_b - lse).exp() * out_b, lse


class _Shift(torch.autograd.Function):
    """Send x to the next rank of the ring, receive the previous rank's; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x, ranks, me, stats):
        ctx.ranks, ctx.me = ranks, me
        return _exchange(x, ranks, me, +1, stats)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.ranks, ctx.me, -1, None), None, None, None


def _exchange(x: torch.Tensor, ranks: list[int], me: int, step: int, stats: Traffic | None) -> torch.Tensor:
    n = len(ranks)
    got = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), ranks[(me + step) % n]),
           dist.P2POp(dist.irecv, got, ranks[(me - step) % n])]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if stats is not None:
        stats.bytes_sent += x.numel() * x.element_size()
    return got


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 2) in rank order; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, n = group, dist.get_world_size(group)
        x = x.contiguous()
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype)   # gloo wants the ranks' blocks end to end
        dist.all_gather_into_tensor(out, x, group=group)
        out = out.unflatten(0, (n, x.shape[0]))
        if stats is not None:
            stats.bytes_sent += (n - 1) * x.numel() * x.element_size()
        return out.permute(1, 2, 0, 3, 4).reshape(x.shape[0], x.shape[1], n * x.shape[2], x.shape[3])

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        b, h, s, d = grad.shape
        stacked = grad.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous().flatten(0, 1)
        mine = torch.empty((b, h, s // n, d), dtype=grad.dtype)
        dist.reduce_scatter_tensor(mine, stacked, group=ctx.group)
        return mine, None, None


def _all_to_all(x: torch.Tensor, group, stats: Traffic | None) -> torch.Tensor:
    """x [n, ...] -> [n, ...]: block i goes to rank i, block j of the result came from rank j (differentiable)."""
    x = x.contiguous()
    if stats is not None:
        stats.bytes_sent += x.numel() * x.element_size() * (x.shape[0] - 1) // x.shape[0]
    return dist_fn.all_to_all_single(torch.empty_like(x), x, group=group)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, *, method: str = "ring",
              split: str = "contiguous", causal: bool = True, group=None, stats: Traffic | None = None,
              skip: str = "chunks") -> torch.Tensor:
    """This rank's rows of attention over the whole sequence; q, k, v hold the positions `pos` ([b, h, local, d]).

        out = attention(q, k, v, positions(S, rank, world, "zigzag"), method="ulysses", split="zigzag")

    split: the split `pos` came from: every method needs to know which positions the other ranks hold (at 2 ranks
    zigzag's rank 1 holds one run of positions, so it cannot be told from `pos`). skip: what the causal mask lets
    a rank leave out, "chunks" (every hidden pair of position runs) or "blocks" (hidden blocks only): see block()."""
    if method not in METHODS:
        raise ValueError(f"method = {method!r}: must be one of {METHODS}")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    seq_len = pos.numel() * n
    held = [positions(seq_len, r, n, split) for r in range(n)]
    chunk = seq_len // (2 * n) if seq_len % (2 * n) == 0 else 0   # the zigzag chunk: skipping's unit, both splits
    if not torch.equal(held[me], pos):
        raise ValueError(f"rank {me}: pos is not what the {split} split gives this rank of {n}")
    if method == "ring":
        # K and V travel as one tensor: one message per step, and one chain of shifts whose backward runs in the
        # same order on every rank (the gradients' messages then pair up; two chains could interleave differently).
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        acc, kv, last = None, torch.stack((k, v)), None
        for step in range(n):
            source = (me - step) % n                        # whose block this rank holds now
            last = block(q, kv[0], kv[1], pos, held[source], causal, stats, skip, chunk)
            acc = merge(acc, last)
            if step < n - 1:
                kv = _Shift.apply(kv, ranks, me, stats)
        out = acc[0]
        # The last block skipped (a causal mask hiding it): tie it in with a zero, so that this rank's backward
        # still runs every shift's and answers the peers that wait for its gradient message.
        return out if last is not None else out + 0 * kv.sum()
    if method == "allgather":
        kv_all = _GatherSeq.apply(torch.stack((k, v)).flatten(0, 1), group, stats).unflatten(0, (2, k.shape[0]))
        return block(q, kv_all[0], kv_all[1], pos, torch.cat(held), causal, stats, skip, chunk)[0]
    heads = q.shape[1]
    if heads % n:
        raise ValueError(f"ulysses over {n} ranks needs a head count divisible by {n}; the model has {heads} heads "
                         "(gloo's all_to_all_single would cut through a head without saying so)")
    b, _, s, d = q.shape
    qkv = torch.stack((q, k, v)).reshape(3, b, n, heads // n, s, d).permute(2, 0, 1, 3, 4, 5)  # [n, 3, b, h/n, s, d]
    got = _all_to_all(qkv, group, stats)                    # [n sources, 3, b, h/n, s, d]: every position, h/n heads
    q_h, k_h, v_h = got.permute(1, 2, 3, 0, 4, 5).reshape(3, b, heads // n, n * s, d)
    full_pos = torch.cat(held)
    out = block(q_h, k_h, v_h, full_pos, full_pos, causal, stats, skip, chunk)[0]
    back = out.reshape(b, heads // n, n, s, d).permute(2, 0, 1, 3, 4)   # [n, b, h/n, s, d]: block j to rank j
    return _all_to_all(back, group, stats).transpose(0, 1).reshape(b, heads, s, d)
