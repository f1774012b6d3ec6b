"""One DeviceMesh per rank for a run's ParallelDims, and every process group derived from it: the only place in
training/ (and run/) that calls init_device_mesh or new_group.

    mesh = Mesh.of(config.parallel_dims, ctx.device)   # once per rank: every rank builds the same groups
    mesh.sub("tp")            # the 1-D DeviceMesh of this rank's tensor-parallel ranks (DTensor plans take it)
    mesh.sub("dp", "cp")      # dp x cp flattened into one dimension (what DDP / FSDP2 reduce over under CP)
    mesh.group("cp")          # its ProcessGroup (None when this rank has no peer on it)
    mesh.groups_of([[0, 3], [4, 7]])   # extra groups (a pipeline's tied ends): every rank builds every one

**Why one place.** torch requires every rank to create every process group, in the same order, even groups it is
not in (new_group is a collective over the world); one rank that creates them in another order, or skips one,
hangs the run at the next collective. Groups built here come from one mesh in ORDER (labkit/dims.py), so each
parallelism asks for its ranks by name and no two places can disagree about who is a neighbour of whom.

**What is built, and when.** Dimensions of degree 1 are left out of the mesh (a 1-rank group costs a rendezvous and
carries nothing). The mesh itself is built on first use: strategies that need no group (DDP over the whole world)
build none. Flattened dimensions (`sub("dp", "cp")`) are built once and kept. `Mesh.of` keeps one Mesh per process
and default group, so a pipeline's stages and the strategy that wraps them share it.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ...dims import ORDER, ParallelDims

_MESHES: dict[tuple, Mesh] = {}


class Mesh:
    """This rank's mesh over `dims` (see the module docstring):  Mesh.of(ParallelDims(dp=2, tp=2), "cpu")."""

    def __init__(self, dims: ParallelDims, device: Any):
        self.dims = dims
        self.device_type = getattr(device, "type", device)
        self.rank = dist.get_rank()
        if dist.get_world_size() != dims.world:
            raise ValueError(f"{dims.describe()} needs {dims.world} ranks; this process group has "
                             f"{dist.get_world_size()}")
        self._mesh: Any = None
        self._flat: dict[tuple[str, ...], Any] = {}
        self._extra: dict[tuple, Any] = {}

    @classmethod
    def of(cls, dims: ParallelDims, device: Any) -> Mesh:
        """The one Mesh of this process for `dims` (made on the first call, the same object afterwards)."""
        key = (dims, getattr(device, "type", device), id(dist.group.WORLD))
        if key not in _MESHES:
            _MESHES[key] = cls(dims, device)
        return _MESHES[key]

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate on each dimension."""
        return self.dims.coords(self.rank)

    @property
    def device_mesh(self) -> Any:
        """The DeviceMesh over the dimensions of degree > 1, in ORDER (all ranks as one "dp" dimension when nothing
        else is split)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            names = self.dims.used() or ("dp",)
            shape = tuple(getattr(self.dims, n) for n in names)
            self._mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
        return self._mesh

    def sub(self, *names: str) -> Any:
        """The DeviceMesh of `names` (in ORDER; several are flattened into one dimension named "dp_cp"...), None
        when all of them have degree 1."""
        unknown = set(names) - set(ORDER)
        if unknown:
            raise ValueError(f"{sorted(unknown)}: not a dimension; the dimensions are {ORDER}")
        mesh = self.device_mesh
        kept = tuple(n for n in ORDER if n in names and n in mesh.mesh_dim_names)
        if not kept:
            return None
        if len(kept) == 1:
            return mesh if mesh.ndim == 1 else mesh[kept[0]]
        if kept not in self._flat:
            self._flat[kept] = mesh[kept]._flatten("_".join(kept))
        return self._flat[kept]

    def group(self, *names: str) -> Any:
        """The ProcessGroup of this rank's ranks along `names`; None when it has no peer there."""
        sub = self.sub(*names) if any(getattr(self.dims, n) > 1 for n in names) else None
        return None if sub is None else sub.get_group()

    def groups_of(self, partition: list[list[int]]) -> Any:
        """Groups that are not a mesh dimension (a pipeline's first and last stages, the experts' ranks): every rank
        creates every group of `partition`, in its order; returns this rank's (None when it is in none). Made once
        per partition."""
        key = tuple(map(tuple, partition))
        if key not in self._extra:
            mine = None
            for ranks in partition:
                group = dist.new_group(list(ranks))
                if self.rank in ranks:
                    mine = group
            self._extra[key] = mine
        return self._extra[key]

    def expert_groups(self) -> tuple[Any, Any]:
        """(this rank's expert-parallel group, the group of ranks holding copies of its experts), from the dims'
        "ep" and "edp" partitions of the data-parallel ranks; None where a group would be this rank alone."""
        out = []
        for kind in ("ep", "edp"):
            partition = self.dims.groups(kind)
            out.append(self.groups_of(partition) if len(partition[0]) > 1 else None)
        return out[0], out[1]


def world_mesh(device: Any) -> Any:
    """A 1-D DeviceMesh over every rank (a lesson's demo on the whole world)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(getattr(device, "type", device), (dist.get_world_size(),))
