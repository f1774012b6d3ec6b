"""Parallelisms that compose: every combination the README lists trains like one process, on real gloo ranks.

SGD (not Adam, whose update barely changes when a gradient is scaled: a sum where a mean belongs would hide) and a
large learning rate, so that a gradient missing a reduction, reduced twice or fed another batch moves the loss.
"""
import ast
from pathlib import Path

import pytest

import labkit
from labkit import RunConfig

BASE = dict(task="tinylm", steps=4, global_batch=8, layers=2, seq_len=16, lr=0.5, optimizer="sgd",
            save_final=False, tensorboard=False)
MATRIX = {
    "dp2 x tp2": dict(world_size=4, tensor_parallel=2),
    "dp2 x cp2": dict(world_size=4, context_parallel=2),
    "tp2 x cp2": dict(world_size=4, tensor_parallel=2, context_parallel=2),
    "pp2 x dp2": dict(world_size=4, strategy="pp", pipeline_ranks=2),
    "pp2 x tp2": dict(world_size=4, strategy="pp", pipeline_ranks=2, tensor_parallel=2),
    "dp2 x tp2 x cp2": dict(world_size=8, tensor_parallel=2, context_parallel=2),
    "pp2 x tp2 x dp2": dict(world_size=8, strategy="pp", pipeline_ranks=2, tensor_parallel=2),
    "fsdp: dp2 x tp2 x cp2": dict(world_size=8, tensor_parallel=2, context_parallel=2, strategy="fsdp"),
}
TOLERANCE = 1e-5   # measured: within 1.5e-6 of one process over 4 steps (float32 sums in another order)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = labkit.launch(RunConfig(**BASE, world_size=1), runs_root=tmp_path_factory.mktemp("runs"), echo=False,
                        progress=False)
    return run.steps().set_index("step").loss


@pytest.mark.parametrize("name", MATRIX)
def test_each_combination_trains_like_one_process(name, one_process, runs_root, no_leftovers):
    cfg = RunConfig(**BASE, **MATRIX[name])
    run = labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False, timeout=120)
    loss = run.steps().set_index("step").loss
    assert len(loss) == 4 and one_process.iloc[-1] != one_process.iloc[0]
    assert (loss - one_process).abs().max() < TOLERANCE, (name, loss.tolist(), one_process.tolist())
    samples = run.df.groupby("step").samples.sum()
    assert (samples == BASE["global_batch"]).all(), f"{name}: every sample credited once, {samples.tolist()}"


def test_a_batch_fed_to_the_wrong_ranks_is_caught_by_the_comparison(one_process, runs_root, no_leftovers,
                                                                     monkeypatch):
    """The comparison above can fail: tensor-parallel ranks reading different rows (rank % dp for rank // tp) train
    on another batch than one process (the ranks are forked: they inherit the patch)."""
    from labkit.training.parallel import shared
    monkeypatch.setattr(shared.SharedBatches, "batch",
                        lambda self, step, micro, rank: self.inner.batch(step, micro, rank % self.dims.dp))
    cfg = RunConfig(**BASE, world_size=4, tensor_parallel=2)
    run = labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False, timeout=120, start_method="fork")
    loss = run.steps().set_index("step").loss
    assert (loss - one_process).abs().max() > 100 * TOLERANCE


def test_only_the_mesh_module_makes_process_groups_in_training_and_run():
    package = Path(labkit.__file__).parent
    makers = {"new_group", "init_device_mesh"}
    found = []
    for path in [*package.glob("training/**/*.py"), *package.glob("run/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in makers:
                    found.append(str(path.relative_to(package)))
    assert set(found) == {"training/parallel/mesh.py"}, found


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_replicated_or_sharded_tp_run_saves_every_parameter_whole(strategy, runs_root, no_leftovers):
    """DDP(device_mesh=...) over TP unregisters the split weights after the first forward (torch's workaround): the
    final state dict lost them. FSDP2's replicate keeps them: every parameter of the (linear) GPT-2, gathered whole."""
    import torch
    from labkit.tricks import compose
    cfg = RunConfig(**{**BASE, "save_final": True}, world_size=4, tensor_parallel=2, strategy=strategy)
    run = labkit.launch(cfg, runs_root=runs_root, echo=False, progress=False, timeout=120)
    saved = torch.load(run.path / "final" / "rank0.pt")
    whole = {name: p.shape for name, p in compose.gpt2_ready(cfg).named_parameters()}
    assert {name: value.shape for name, value in saved.items() if name in whole} == whole
    held = run.df[run.df.step == 0].param_bytes
    assert (held < sum(4 * torch.Size(s).numel() for s in whole.values())).all()   # the TP slices, not the whole
