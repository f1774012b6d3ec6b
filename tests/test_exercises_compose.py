"""Lesson 25's capstone checker: the reference passes, each classic mistake is named in one line, a stub is "not
written yet", on real gloo ranks (4: tp2 x cp2 and dp2 x tp2)."""
import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from labkit.exercises import COMPOSE_REFERENCE, check_parallelize
from labkit.tricks import compose

build_mesh, which_batch, parallelize = COMPOSE_REFERENCE


def shard_first(model, dims, mesh):
    fully_shard(model, mesh=compose.flat(mesh, "dp", "cp"))
    for block in model.transformer.h:
        parallelize_module(block, mesh["tp"], compose.block_plan())
        compose.local_heads(block, dims.tp)
    compose.context_attention(model, mesh["cp"].get_group())
    return model


def reversed_mesh(dims):
    return init_device_mesh("cpu", (dims.tp, dims.cp, dims.dp), mesh_dim_names=("tp", "cp", "dp"))


def tp_ranks_apart(rank, dims):
    return rank % dims.dp, rank // dims.tp % dims.cp


def cp_ranks_alike(rank, dims):
    return rank // (dims.cp * dims.tp), 0


def dp_only(model, dims, mesh):
    for block in model.transformer.h:
        parallelize_module(block, mesh["tp"], compose.block_plan())
        compose.local_heads(block, dims.tp)
    compose.context_attention(model, mesh["cp"].get_group())
    fully_shard(model, mesh=mesh["dp"])
    return model


def not_written(model, dims, mesh):
    raise NotImplementedError("parallelize: not written yet")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cases = {"reference": COMPOSE_REFERENCE, "shard_first": (build_mesh, which_batch, shard_first),
             "reversed_mesh": (reversed_mesh, which_batch, parallelize),
             "tp_ranks_apart": (build_mesh, tp_ranks_apart, parallelize),
             "cp_ranks_alike": (build_mesh, cp_ranks_alike, parallelize),
             "dp_only": (build_mesh, which_batch, dp_only), "not_written": (build_mesh, which_batch, not_written)}
    return {name: check_parallelize(*funcs, runs_root=root) for name, funcs in cases.items()}


def test_the_reference_passes_within_float_rounding(reports):
    report = reports["reference"]
    assert report.ok, report.text()
    assert all(error < 1e-5 for error in report.measured["grad_error"].values())


@pytest.mark.parametrize("case, check, part, words", [
    ("shard_first", "runs", "parallelize", "sharding before TP: fully_shard ran before parallelize_module"),
    ("reversed_mesh", "mesh", "build_mesh", "a mesh dimension in the wrong order"),
    ("tp_ranks_apart", "batch", "which_batch", "tensor-parallel ranks 0 and 1 read different batches"),
    ("cp_ranks_alike", "batch", "which_batch", "each must read its own part"),
    ("dp_only", "gradients", "parallelize", "it is not reduced over 'cp'"),
])
def test_each_classic_mistake_is_named_in_one_line(reports, case, check, part, words):
    report = reports[case]
    assert not report.ok and report.status(check) == "fail", report.text()
    assert report.blamed == [part] and words in report.failures[0], report.text()
    assert "\n" not in report.failures[0]


def test_a_stub_is_not_written_yet(reports):
    report = reports["not_written"]
    assert report.missing and not report.failures, report.text()
