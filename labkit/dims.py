"""How a run's ranks are split between the parallelisms: plain integers, no torch (the mesh is built from them in
training/parallel/mesh.py).

    dims = ParallelDims(dp=2, tp=2, cp=2)        # 8 ranks
    dims.world, dims.coords(5)                   # 8, {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
    dims.groups("tp")                            # [[0, 1], [2, 3], [4, 5], [6, 7]]: the ranks that split each block
    dims.batch_per_rank(global_batch=32)         # 16: the samples each data-parallel share reads
    ParallelDims.fit(6, tp=4)                    # raises DimsError naming the degrees that would fit

**The order of the dimensions** is ORDER = (dp, pp, cp, tp), outermost first, as picotron's
`torch.arange(world).view(dp, pp, cp, tp)`: rank = ((d * pp + p) * cp + c) * tp + t. Tensor parallelism is innermost
because it talks the most (two all-reduces per block in forward, two in backward): on GPUs its ranks are then
neighbours on one node's fast links. This is also the order every labkit run had before the dims existed: a
pipeline's replicas were rank // pipeline_ranks, context groups and tensor-parallel pairs were neighbours, so saved
runs keep their layout. (torchtitan puts pp outermost instead: pipeline traffic is the lightest, point-to-point,
and crosses nodes best; both orders are correct, what matters is that every group is read from one mesh.)

**Expert parallelism is carved out of data parallelism** (as torchtitan does): ep divides dp, and the data-parallel
coordinate d = outer * ep + e. The ranks of one EP group (same outer, every e) split each layer's experts; the ranks
with the same e hold copies of the same experts and average their gradients ("edp").

**Data parallelism** (`dp`) is the ranks left over: dp = world / (pp * cp * tp). `shard` says how they hold the model:
False replicates it (DDP), True shards it (FSDP2, ZeRO-3). Ranks that differ only in their tp or cp coordinate read
the same samples: tensor-parallel ranks all of them, context-parallel ranks a share of each sample's positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ORDER = ("dp", "pp", "cp", "tp")
"""The mesh's dimensions, outermost first (see the module docstring)."""
NAMES = {"dp": "data", "pp": "pipeline", "cp": "context", "tp": "tensor", "ep": "expert"}


class DimsError(ValueError):
    """Degrees that do not fit together (their product is not the world size, ep does not divide dp, ...)."""


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism (see the module docstring):  ParallelDims(dp=2, tp=2)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    shard: bool = False
    """How the data-parallel ranks hold the model: False replicated (DDP), True sharded (FSDP2)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise DimsError("; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these degrees on their own, as sentences (empty when they fit)."""
        out = [f"{name} = {getattr(self, name)!r}: the {NAMES[name]}-parallel degree must be an integer >= 1"
               for name in (*ORDER, "ep") if not _count(getattr(self, name))]
        if not out and self.dp % self.ep:
            out.append(f"ep = {self.ep}: expert parallelism is carved out of the {self.dp} data-parallel ranks, so "
                       f"it must divide dp = {self.dp}; use one of {divisors(self.dp)}")
        return out

    @classmethod
    def fit(cls, world: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
            shard: bool = False) -> ParallelDims:
        """The dims of `world` ranks with these degrees, dp being what is left:  ParallelDims.fit(8, tp=2, cp=2).dp
        == 2. Raises DimsError naming the degrees that would fit when they do not divide the world."""
        used = tp * pp * cp
        if not all(_count(v) for v in (world, tp, pp, cp, ep)):
            raise DimsError(f"world = {world!r}, tp = {tp!r}, pp = {pp!r}, cp = {cp!r}, ep = {ep!r}: every degree "
                            "must be an integer >= 1")
        if world % used:
            fits = [d for d in divisors(world) if d > 1]
            raise DimsError(f"tp x pp x cp = {tp} x {pp} x {cp} = {used} does not divide the {world} ranks (the "
                            f"data-parallel degree is what is left); their product must be one of {fits or [1]}")
        return cls(dp=world // used, tp=tp, pp=pp, cp=cp, ep=ep, shard=shard)

    @property
    def world(self) -> int:
        """Ranks in all: dp * pp * cp * tp."""
        return self.dp * self.pp * self.cp * self.tp

    def used(self) -> tuple[str, ...]:
        """The dimensions with more than one rank, in ORDER: ("dp", "tp") for ParallelDims(dp=2, tp=2)."""
        return tuple(name for name in ORDER if getattr(self, name) > 1)

    def coords(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on each dimension:  ParallelDims(dp=2, tp=2).coords(3) == {"dp": 1, "pp": 0, "cp": 0,
        "tp": 1}."""
        if not (_count(rank + 1 if isinstance(rank, int) else rank) and rank < self.world):
            raise DimsError(f"rank {rank!r}: these dims hold ranks 0 to {self.world - 1}")
        out = {}
        for name in reversed(ORDER):
            rank, out[name] = divmod(rank, getattr(self, name))
        return {name: out[name] for name in ORDER}

    def rank_of(self, **coords: int) -> int:
        """The rank at these coordinates (the others 0):  ParallelDims(dp=2, tp=2).rank_of(dp=1) == 2."""
        unknown = set(coords) - set(ORDER)
        if unknown:
            raise DimsError(f"{sorted(unknown)}: not a dimension; the dimensions are {ORDER}")
        rank = 0
        for name in ORDER:
            degree, at = getattr(self, name), coords.get(name, 0)
            if not 0 <= at < degree:
                raise DimsError(f"{name} = {at}: the {NAMES[name]}-parallel coordinate runs from 0 to {degree - 1}")
            rank = rank * degree + at
        return rank

    def groups(self, *names: str) -> list[list[int]]:
        """The ranks that vary along `names` (the other coordinates equal), one list per group, in rank order:
        ParallelDims(dp=2, cp=2).groups("cp") == [[0, 1], [2, 3]]; groups("dp", "cp") is every rank. "ep" and "edp"
        split the data-parallel dimension (see the module docstring)."""
        if names in (("ep",), ("edp",)):
            return self._expert_groups(names[0])
        unknown = set(names) - set(ORDER)
        if unknown:
            raise DimsError(f"{sorted(unknown)}: not a dimension; the dimensions are {ORDER} (and 'ep', 'edp')")
        found: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            at = self.coords(rank)
            key = tuple(at[n] for n in ORDER if n not in names)
            found.setdefault(key, []).append(rank)
        return list(found.values())

    def group_of(self, rank: int, *names: str) -> list[int]:
        """The one group of groups(*names) that holds `rank`."""
        return next(g for g in self.groups(*names) if rank in g)

    def _expert_groups(self, kind: str) -> list[list[int]]:
        found: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            at = self.coords(rank)
            outer, e = divmod(at["dp"], self.ep)
            rest = tuple(at[n] for n in ORDER if n != "dp")
            key = (outer, *rest) if kind == "ep" else (e, *rest)
            found.setdefault(key, []).append(rank)
        return list(found.values())

    def data_rank(self, rank: int) -> int:
        """Which data-parallel share `rank` reads: its dp coordinate (tp, cp and pp ranks of one replica share)."""
        return self.coords(rank)["dp"]

    def batch_per_rank(self, global_batch: int, grad_accum: int = 1) -> int:
        """Samples one data-parallel share reads per micro-batch: global_batch / (dp * grad_accum). Its tensor-
        parallel ranks read all of them; its context-parallel ranks each a share of every sample's positions."""
        return global_batch // (self.dp * grad_accum)

    def describe(self) -> str:
        """"dp2 x tp2 (4 ranks)"; "1 rank" when nothing is split."""
        parts = [f"{name}{getattr(self, name)}" for name in self.used()]
        if self.ep > 1:
            parts.append(f"ep{self.ep} (inside dp)")
        ranks = f"{self.world} rank{'s' if self.world > 1 else ''}"
        return f"{' x '.join(parts)} ({ranks})" if parts else ranks

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (*ORDER, "ep", "shard")}


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending:  divisors(12) == [1, 2, 3, 4, 6, 12]."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
