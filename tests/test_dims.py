"""ParallelDims: the degrees, where each rank sits, who shares a batch (pure: no ranks started)."""
import pytest

from labkit import ConfigError, RunConfig
from labkit.dims import DimsError, ParallelDims, divisors


def test_rank_order_is_dp_pp_cp_tp_with_tp_innermost():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert [dims.coords(r) for r in (0, 1, 2, 5)] == [
        {"dp": 0, "pp": 0, "cp": 0, "tp": 0}, {"dp": 0, "pp": 0, "cp": 0, "tp": 1},
        {"dp": 0, "pp": 1, "cp": 0, "tp": 0}, {"dp": 1, "pp": 0, "cp": 0, "tp": 1}]
    assert all(dims.rank_of(**dims.coords(r)) == r for r in range(dims.world))
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_every_group_partitions_the_world():
    dims = ParallelDims(dp=2, cp=2, tp=2)
    for names in (("dp",), ("cp",), ("tp",), ("dp", "cp"), ("cp", "tp"), ("dp", "cp", "tp")):
        groups = dims.groups(*names)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert {len(g) for g in groups} == {eval("*".join(f"dims.{n}" for n in names))}


def test_expert_parallel_is_carved_out_of_data_parallel():
    dims = ParallelDims(dp=4, ep=2)
    assert dims.groups("ep") == [[0, 1], [2, 3]] and dims.groups("edp") == [[0, 2], [1, 3]]
    with pytest.raises(DimsError, match="ep = 3: .* must divide dp = 4; use one of \\[1, 2, 4\\]"):
        ParallelDims(dp=4, ep=3)


def test_tp_and_cp_ranks_of_one_replica_read_one_data_share():
    dims = ParallelDims(dp=2, cp=2, tp=2)
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.batch_per_rank(32, grad_accum=2) == 8


def test_degrees_that_do_not_fit_say_what_would():
    with pytest.raises(DimsError, match="4 x 1 x 1 = 4 does not divide the 6 ranks.*one of \\[2, 3, 6\\]"):
        ParallelDims.fit(6, tp=4)
    with pytest.raises(DimsError, match="integer >= 1"):
        ParallelDims(dp=0)
    with pytest.raises(DimsError, match="ranks 0 to 3"):
        ParallelDims(dp=2, tp=2).coords(4)
    assert ParallelDims.fit(8, tp=2, cp=2).dp == 2 and divisors(12) == [1, 2, 3, 4, 6, 12]


@pytest.mark.parametrize("fields, dims", [
    (dict(), ParallelDims(dp=2)),
    (dict(world_size=4, strategy="fsdp+tp"), ParallelDims(dp=2, tp=2, shard=True)),
    (dict(world_size=4, strategy="tp"), ParallelDims(tp=4)),
    (dict(world_size=4, tensor_parallel=2), ParallelDims(dp=2, tp=2)),
    (dict(world_size=4, tensor_parallel=2, context_parallel=2), ParallelDims(tp=2, cp=2)),
    (dict(world_size=8, tensor_parallel=2, context_parallel=2, strategy="fsdp"),
     ParallelDims(dp=2, tp=2, cp=2, shard=True)),
    (dict(world_size=4, strategy="pp", pipeline_ranks=2, layers=2), ParallelDims(dp=2, pp=2)),
    (dict(world_size=4, strategy="pp", tensor_parallel=2, layers=2), ParallelDims(pp=2, tp=2)),
    (dict(world_size=8, strategy="pp", pipeline_ranks=2, tensor_parallel=2, layers=2), ParallelDims(dp=2, pp=2, tp=2)),
    (dict(world_size=4, task="tinymoe", expert_parallel=2), ParallelDims(dp=4, ep=2)),
])
def test_runconfig_parallel_dims(fields, dims):
    cfg = RunConfig(**{"global_batch": 16, **fields})
    assert cfg.parallel_dims == dims and cfg.parallel_dims.world == cfg.world_size


@pytest.mark.parametrize("fields, words", [
    (dict(world_size=4, tensor_parallel=2, strategy="zero1"), "composes with strategy 'ddp', 'fsdp', 'pp'"),
    (dict(world_size=4, tensor_parallel=2, strategy="fsdp+tp"), "a preset that sets the tensor-parallel degree"),
    (dict(world_size=6, tensor_parallel=4, global_batch=12), "tensor x context x pipeline ranks = 4 must divide"),
    (dict(world_size=4, tensor_parallel=3, global_batch=12), "attention heads"),
    (dict(world_size=4, tensor_parallel=2, task="digits"), "not task 'digits'"),
    (dict(world_size=4, strategy="pp", tensor_parallel=2, layers=2, sequence_parallel=True),
     "not with a pipeline"),
    (dict(world_size=4, context_parallel=2, strategy="pp", layers=2), "pipeline x context parallelism is not built"),
    (dict(world_size=4, tensor_parallel=2, precision="fp8"), "RunConfig.precision = 'fp8'"),
])
def test_combinations_torch_cannot_run_here_are_refused_in_one_line(fields, words):
    with pytest.raises(ConfigError) as info:
        RunConfig(**{"global_batch": 16, **fields})
    assert words in str(info.value)
