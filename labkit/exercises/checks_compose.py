"""The capstone (lesson 25): compose DP x TP x CP yourself on one DeviceMesh, checked on real gloo ranks against
one process.

    def build_mesh(dims): ...                  # a DeviceMesh over ("dp", "cp", "tp"), outermost first
    def which_batch(rank, dims): ...           # -> (data shard, sequence part) this rank reads
    def parallelize(model, dims, mesh): ...    # TP in each block, CP attention, FSDP2 over dp x cp; -> the model
    report = check_parallelize(build_mesh, which_batch, parallelize)              # 4 ranks: tp2 x cp2, dp2 x tp2
    report = check_parallelize(build_mesh, which_batch, parallelize, full=True)   # 8 ranks: dp2 x cp2 x tp2
    build_mesh, which_batch, parallelize = report.use(COMPOSE_REFERENCE)          # yours once they pass

Each layout runs one forward and backward of tinylm's GPT-2 on the learner's layout (each rank its share of one
batch of 8 sequences of 16 tokens) and compares every gradient, gathered whole, with one process's on the whole
batch. Each piece is judged with labkit's reference standing in for the others, and the usual mistakes are named:

    mesh        your mesh's groups against labkit's layout (rank = (d * cp + c) * tp + t): a dimension in the wrong
                order ("your 'tp' ranks of rank 0 are [0, 2]; they must be neighbours [0, 1]"), one missing
    batch       (judged without ranks, on 8 ranks dp2 x cp2 x tp2) tensor-parallel ranks must read the same rows and
                the same positions; context-parallel ranks the same rows, each its own part; data-parallel ranks
                their own rows
    order       fully_shard before parallelize_module: FSDP2 would shard, and TP then split, FSDP2's shards (or
                refuse them), not the matrices
    split       TP applied: the blocks' weights are DTensors on a "tp" dimension
    gradients   every gradient within 1e-4 of one process's; otherwise the dimension it was not averaged over
                (ranks that should agree differ) or its scale (summed, not averaged: 2.000x)
"""
from __future__ import annotations

import functools
from typing import Any

from ..dims import ParallelDims
from .compose_rank import (DIMS, SHARDED_FIRST, drive_compose, shard_first, reference_build_mesh, reference_parallelize,
                           reference_which_batch)
from .learner import run_checked
from .report import Report

TOLERANCE = 1e-4
QUICK_LAYOUTS = (ParallelDims(tp=2, cp=2), ParallelDims(dp=2, tp=2))   # the CP mistakes show on the first
FULL_LAYOUTS = (ParallelDims(dp=2, cp=2, tp=2),)


class Composition(tuple):
    """(build_mesh, which_batch, parallelize), as check_parallelize takes them and report.use hands them back."""

    def __new__(cls, build_mesh: Any, which_batch: Any, parallelize: Any) -> "Composition":
        return super().__new__(cls, (build_mesh, which_batch, parallelize))

    @property
    def __name__(self) -> str:
        return ", ".join(getattr(f, "__name__", repr(f)) for f in self)


COMPOSE_REFERENCE = Composition(reference_build_mesh, reference_which_batch, reference_parallelize)


def check_parallelize(build_mesh: Any, which_batch: Any, parallelize: Any, *, full: bool = False,
                      timeout: float = 60.0, runs_root: Any = None) -> Report:
    """Run the learner's three functions on real ranks (QUICK_LAYOUTS on 4, or FULL_LAYOUTS on 8) against one
    process and report each piece (see the module docstring):  check_parallelize(*COMPOSE_REFERENCE).ok."""
    funcs = Composition(build_mesh, which_batch, parallelize)
    layouts = FULL_LAYOUTS if full else QUICK_LAYOUTS
    report = Report(f"{funcs.__name__}: {', '.join(d.describe() for d in layouts)} against one process",
                    implementation=funcs)
    batch_ok = _batch(report, which_batch)
    if batch_ok is None:
        return report
    for dims in layouts:
        drive = functools.partial(drive_compose, build_mesh=build_mesh,
                                  which_batch=which_batch if batch_ok else reference_which_batch,
                                  parallelize=parallelize, dims=dims.to_dict() | {"shard": False})
        got = run_checked(report, drive, world_size=dims.world, timeout=timeout, name="check-compose",
                          runs_root=runs_root)
        if got is None:
            return report
        # `&`, not `and`: each piece is judged (the ranks ran the reference mesh in place of a wrong one)
        if not (_mesh(report, got, dims) & _order(report, got) & _gradients(report, got, dims)):
            return report
    report.add("runs", "pass", f"every rank finished: {', '.join(d.describe() for d in layouts)}")
    return report


def _batch(report: Report, which_batch: Any) -> bool | None:
    """which_batch on every rank of dp2 x cp2 x tp2, judged by who must read what (None: not written yet)."""
    dims = ParallelDims(dp=2, cp=2, tp=2)
    try:
        got = {rank: tuple(which_batch(rank, dims)) for rank in range(dims.world)}
    except NotImplementedError:
        report.add("written", "missing", "which_batch is not written yet (it raised NotImplementedError). Write it "
                                         "in the ✏️ cell and run the check again.")
        return None
    except Exception as exc:   # noqa: BLE001 - the learner's code: any raise is a verdict
        report.add("batch", "fail", f"which_batch(rank, dims) raised {type(exc).__name__}: {exc}", part="which_batch")
        return False
    for name, kind in (("tp", "tensor"), ("cp", "context")):
        for group in dims.groups(name):
            seen = {r: got[r] for r in group}
            shards = {v[0] for v in seen.values()}
            parts = [v[1] for v in seen.values()]
            if len(shards) > 1:
                a, b = group[0], next(r for r in group if got[r][0] != got[group[0]][0])
                report.add("batch", "fail", f"{kind}-parallel ranks {a} and {b} read different batches (data shards "
                                            f"{got[a][0]} and {got[b][0]}): the ranks that split one "
                                            f"{'block' if name == 'tp' else 'sequence'} must compute on the same "
                                            "samples", part="which_batch")
                return False
            if name == "tp" and len(set(parts)) > 1:
                report.add("batch", "fail", f"tensor-parallel ranks {group} read different parts of the sequence "
                                            f"{parts}: they split the matrices, not the positions", part="which_batch")
                return False
            if name == "cp" and sorted(parts) != list(range(dims.cp)):
                report.add("batch", "fail", f"context-parallel ranks {group} read parts {parts}: each must read its "
                                            f"own part, 0 to {dims.cp - 1}", part="which_batch")
                return False
    per_dp = [got[dims.rank_of(dp=d)][0] for d in range(dims.dp)]
    if sorted(per_dp) != list(range(dims.dp)):
        report.add("batch", "fail", f"the data-parallel replicas read shards {per_dp}: each must read its own, 0 to "
                                    f"{dims.dp - 1}", part="which_batch")
        return False
    report.add("batch", "pass", "tensor-parallel ranks read one batch, context-parallel ranks each their part of it, "
                                "data-parallel replicas their own rows")
    return True


def _mesh(report: Report, got: list[dict], dims: ParallelDims) -> bool:
    for r in got:
        for name in DIMS:
            want = dims.group_of(r["rank"], name)
            mine = r["mesh"][name]
            if mine == want:
                continue
            said = (f"your mesh has no {name!r} dimension (its names: {r['mesh_names']}); name all three, "
                    f"{DIMS}, sizes 1 included" if mine is None else
                    f"your {name!r} ranks of rank {r['rank']} are {mine}; labkit's layout (dp, cp, tp, tp innermost, "
                    f"as which_batch reads it) puts {want} together: a mesh dimension in the wrong order")
            report.add("mesh", "fail", f"{dims.describe()}: {said}", part="build_mesh")
            return False
    report.add("mesh", "pass", f"{dims.describe()}: every dimension's ranks are labkit's layout's")
    return True


def _order(report: Report, got: list[dict]) -> bool:
    if shard_first(got[0]["calls"]):
        report.add("order", "fail", SHARDED_FIRST, part="parallelize")
        return False
    if not got[0]["tp_split"] and got[0]["mesh"]["tp"] and len(got[0]["mesh"]["tp"]) > 1:
        report.add("split", "fail", "the blocks' weights are not split over 'tp' (no DTensor on a 'tp' dimension): "
                                    "parallelize_module(block, mesh['tp'], block_plan()) for each block",
                   part="parallelize")
        return False
    return True


def _gradients(report: Report, got: list[dict], dims: ParallelDims) -> bool:
    worst = max(((g["error"], name, r["rank"]) for r in got for name, g in r["grads"].items() if "error" in g),
                default=(0.0, "", 0))
    shapes = [(r["rank"], name, g["shape"]) for r in got for name, g in r["grads"].items() if "shape" in g]
    if shapes:
        rank, name, shape = shapes[0]
        report.add("gradients", "fail", f"rank {rank}: the gradient of {name} gathers to shape {shape}, not the "
                                        "model's: a dimension is split twice or not at all", part="parallelize")
        return False
    if worst[0] <= TOLERANCE:
        report.add("gradients", "pass", f"{dims.describe()}: every gradient within {worst[0]:.1e} of one process's "
                                        "on the whole batch")
        report.measured.setdefault("grad_error", {})[dims.describe()] = worst[0]
        return True
    error, name, rank = worst
    for dim in ("dp", "cp", "tp"):
        for group in dims.groups(dim):
            probes = [tuple(round(v, 6) for v in got[r]["grads"][name]["probe"]) for r in group]
            if len(set(probes)) > 1:
                report.add("gradients", "fail", f"{dims.describe()}: the gradient of {name} differs between the "
                                                f"{dim} ranks {group}: it is not reduced over {dim!r} (FSDP2's mesh "
                                                "must cover dp and cp together)", part="parallelize")
                return False
    scale = got[rank]["grads"][name]["scale"]
    said = (f"gradients are summed, not averaged: {scale:.3f}x one process's" if scale > 1.5 else
            f"off by {error:.3g} of its largest value (scale {scale:.3f}x)")
    report.add("gradients", "fail", f"{dims.describe()}: the gradient of {name} on rank {rank}: {said}",
               part="parallelize")
    return False
