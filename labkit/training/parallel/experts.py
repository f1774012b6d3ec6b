"""Expert parallelism: each rank owns some experts as its own parameters; tokens travel to them by all_to_all.

    bank = ExpertBank.from_fused(model.model.layers[0].mlp.experts, experts=range(4, 8))   # experts 4..7, copied
    layer.mlp.experts = ExpertParallel(bank, num_experts=8, group=ep_group)   # EP: the other experts elsewhere
    layer.mlp.experts = ExpertParallel(ExpertBank.from_fused(fused), num_experts=8, every_expert=False)
                                               # one process, one parameter set per expert, idle experts skipped

`ExpertParallel` has the signature of transformers' DeepseekV3Experts (hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H], so it replaces it inside transformers' DeepseekV3MoE; the router, the shared
expert and the rest of the model are untouched. One forward:
  1. sort this rank's (token, expert) assignments by expert; a weight of exactly 0 is an assignment the capacity
     factor dropped (training/routing.py): it is not sent;
  2. trade counts: an all_to_all of one number per expert tells each rank how many rows it will get from each;
  3. dispatch: all_to_all_single with uneven splits, in its autograd form (torch.distributed.nn.functional), so
     backward sends the gradients back the same way;
  4. each local expert runs on its rows (grouped by expert across the sources);
  5. combine: the reverse all_to_all, then each token adds up its experts' outputs times their weights.
The group is an expert-parallel group carved out of the data-parallel ranks (parallel/moe_layout.py).

Why transformers' own experts escape the unused-expert traps: DeepseekV3Experts holds all experts in two 3-D
parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]). An expert with no tokens is a slice nobody read, but the
parameter as a whole was used, so autograd gives it a gradient (zeros in that slice) and DDP's reducer and FSDP2's
reduce-scatter see every parameter every step. With one parameter set per expert (as here, and in most
hand-written MoEs), an idle expert's parameters get no gradient at all: DDP raises at the next step, FSDP2 never
reduces them on that rank and the others wait. `every_expert=True` (the default) runs every local expert, on no
rows if it got none: the empty matmul still puts its parameters in the graph, with a zero gradient.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from torch.nn import functional as F


class Expert(nn.Module):
    """One routed expert, laid out as one slice of transformers' fused experts: SwiGLU, down(act(gate) * up)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Any):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up.detach().clone())
        self.down_proj = nn.Parameter(down.detach().clone())
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj)


class ExpertBank(nn.Module):
    """Some experts, each its own parameters; forward(rows grouped by expert, rows per expert)."""

    def __init__(self, experts: list[Expert], first: int = 0):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.first = first  # the global index of experts[0]

    @classmethod
    def from_fused(cls, fused: nn.Module, experts: Iterable[int] | None = None) -> "ExpertBank":
        """Copies of experts `experts` (default: all) of a transformers DeepseekV3Experts."""
        ids = list(range(fused.num_experts) if experts is None else experts)
        return cls([Expert(fused.gate_up_proj[e], fused.down_proj[e], fused.act_fn) for e in ids], first=ids[0])

    def forward(self, rows: torch.Tensor, counts: list[int], every_expert: bool = True) -> torch.Tensor:
        outs = [expert(chunk) for expert, chunk in zip(self.experts, rows.split(counts))
                if every_expert or len(chunk)]
        return torch.cat(outs) if outs else rows[:0]


class ExpertParallel(nn.Module):
    """transformers' experts interface over an ExpertBank and, when `group` has more than one rank, all_to_all."""

    def __init__(self, bank: ExpertBank, num_experts: int, group: Any = None, every_expert: bool = True):
        super().__init__()
        self.bank, self.num_experts, self.group, self.every_expert = bank, num_experts, group, every_expert
        self.size = dist.get_world_size(group) if group is not None else 1
        self.local = len(bank.experts)
        if self.local * self.size != num_experts:
            raise ValueError(f"{self.size} ranks x {self.local} experts each != {num_experts} experts")
        self.wire: Any = None  # the forward dispatch's own all_to_all, when set (FP8 payloads: training/fp8_wire.py)
        # called with the rows as this rank's experts receive them, after the dispatch (lesson 20 holds the FP8
        # rows against the fp32 ones): a hook, so that an observer never replaces the dispatch itself
        self.on_arrival: Callable[[torch.Tensor], None] | None = None
        self.stats = dict.fromkeys(("rows_out", "rows_in", "rows_leaving", "t_experts", "t_a2a", "t_combine"), 0.0)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        weights, expert = top_k_weights.reshape(-1), top_k_index.reshape(-1)
        kept = torch.nonzero(weights != 0).squeeze(-1)           # capacity-dropped assignments carry weight 0
        kept = kept[torch.argsort(expert[kept], stable=True)]    # grouped by expert: by destination rank too
        send = torch.bincount(expert[kept], minlength=self.num_experts)
        rows = hidden[kept // k]
        started = time.perf_counter()
        recv = self._trade_counts(send)                           # [source rank, local expert]
        in_splits, out_splits = send.view(self.size, self.local).sum(1).tolist(), recv.sum(1).tolist()
        arrived = self._dispatch(rows, out_splits, in_splits)
        waited = time.perf_counter() - started
        if self.on_arrival is not None:
            self.on_arrival(arrived.detach())
        local_id = torch.arange(self.local).repeat(self.size).repeat_interleave(recv.reshape(-1))
        order = torch.argsort(local_id, stable=True)              # rows of each local expert together
        t0 = time.perf_counter()
        done = self.bank(arrived[order], recv.sum(0).tolist(), self.every_expert)
        t1 = time.perf_counter()
        back = self._all_to_all(done[torch.argsort(order)], in_splits, out_splits)
        combine = time.perf_counter() - t1  # the transfer, and the wait for the ranks whose experts took longer
        self._count(len(kept), len(arrived), len(kept) - in_splits[self._rank()], t1 - t0, waited + combine, combine)
        out = torch.zeros_like(hidden)  # under bf16 autocast the experts' rows come back in bf16: add them as hidden's
        return out.index_add(0, kept // k, (back * weights[kept, None].to(back.dtype)).to(out.dtype))

    def _rank(self) -> int:
        return dist.get_rank(self.group) if self.size > 1 else 0

    def _trade_counts(self, send: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return send.view(1, -1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.view(self.size, self.local)

    def _all_to_all(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        if self.size == 1:
            return rows
        out = rows.new_empty(sum(out_splits), rows.shape[-1])
        return all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=self.group)

    def _dispatch(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        if self.wire is None or self.size == 1:
            return self._all_to_all(rows, out_splits, in_splits)
        return self.wire(rows, out_splits, in_splits, self.group)

    def _count(self, out: int, arrived: int, leaving: int, t_experts: float, t_a2a: float, t_combine: float) -> None:
        for key, value in zip(self.stats, (out, arrived, leaving, t_experts, t_a2a, t_combine)):
            self.stats[key] += value

    def take_stats(self) -> dict[str, float]:
        """Since the last call, forward only: rows handed to dispatch (all of them, this rank's own included),
        rows received, rows that left for other ranks, seconds in the local experts, in all_to_all (counts,
        dispatch and combine) and in the combine alone (where a rank waits for the slowest rank's experts)."""
        out, self.stats = self.stats, dict.fromkeys(self.stats, 0.0)
        return out


def expert_parallel_modules(model: nn.Module) -> list[ExpertParallel]:
    return [m for m in model.modules() if isinstance(m, ExpertParallel)]
