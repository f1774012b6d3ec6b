"""RunConfig.strategy on real gloo ranks: every strategy (and tensor parallelism with sequence parallelism) trains
like DDP, holds what the ZeRO formulas say, and issues the collectives its design says; the counters, the sharded
gradient norm and the TP adaptation by hand. Megatron's all-reduces per block: test_sequence_parallel.py."""
import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import ConfigError, RunConfig
from labkit.training.commhooks import count_collectives
from labkit.training.parallel.dispatchcount import DispatchCounter
from labkit.training.parallel.strategies import COUNTED_STEPS
from labkit.training.tasks import make_task
from labkit.training.parallel.tensor_parallel import linear_gpt2, split_blocks
from labkit import memory
from labkit.tricks import parallel, tpclaim

STEPS = 2
SP = {"sequence_parallel": True}
CASES = [("zero1", 2, {}), ("zero2", 2, {}), ("fsdp", 2, {}), ("tp", 2, {}), ("tp", 4, {}), ("fsdp+tp", 4, {}),
         ("tp", 2, SP), ("fsdp+tp", 4, SP)]


def config(strategy, world, **fields):
    return parallel.lesson_config(strategy, world, steps=fields.pop("steps", STEPS), tensorboard=False, **fields)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {world: labkit.launch(config("ddp", world), runs_root=root, echo=False, progress=False)
            for world in (2, 4)}


# --- configuration ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy, world, dims", [("ddp", 2, (2, 1)), ("zero1", 4, (4, 1)), ("fsdp", 2, (2, 1)),
                                                   ("tp", 4, (1, 4)), ("fsdp+tp", 4, (2, 2)), ("fsdp+tp", 8, (4, 2))])
def test_mesh_shape_multiplies_to_the_world(strategy, world, dims):
    cfg = RunConfig(strategy=strategy, world_size=world, global_batch=8 * world)
    assert (cfg.parallel_dims.dp, cfg.parallel_dims.tp) == dims and cfg.parallel_dims.world == world


@pytest.mark.parametrize("changes, words", [
    ({"strategy": "fsdp+tp", "world_size": 2}, ["world_size = 2", "even and at least 4"]),
    ({"strategy": "fsdp+tp", "world_size": 6, "global_batch": 36}, None),
    ({"strategy": "tp", "world_size": 3, "global_batch": 18}, ["world_size = 3", "attention heads"]),
    ({"strategy": "tp", "task": "digits"}, ["task must be 'tinylm'"]),
    ({"strategy": "fsdp", "precision": "fp16"}, ["precision = 'fp16'"]),
    ({"strategy": "fsdp", "comm_hook": "fp16"}, ["comm_hook = 'fp16'", "DDP comm hook"]),
    ({"strategy": "zero1", "comm_hook": "fp16"}, None),
    ({"strategy": "sharded"}, ["must be one of ddp, zero1, zero2, fsdp, tp, fsdp+tp"]),
])
def test_strategy_combinations_are_checked_before_anything_starts(changes, words):
    if words is None:
        RunConfig(**changes)
        return
    with pytest.raises(ConfigError) as info:
        RunConfig(**changes)
    assert "RunConfig.strategy" in str(info.value)
    for word in words:
        assert word in str(info.value)


# --- every strategy trains like DDP and holds what the formula says ----------------------------------------------

@pytest.mark.parametrize("strategy, world, fields", CASES, ids=[f"{s}-w{w}{'-sp' if f else ''}" for s, w, f in CASES])
def test_strategy_trains_like_ddp_and_holds_what_the_formula_says(strategy, world, fields, ddp_runs, runs_root,
                                                                  no_leftovers):
    run = labkit.launch(config(strategy, world, **fields), runs_root=runs_root, echo=False, progress=False)
    ddp = ddp_runs[world if strategy == "fsdp+tp" else 2]
    ours, theirs = run.steps().set_index("step"), ddp.steps().set_index("step")
    assert (ours.loss - theirs.loss).abs().max() < 1e-5, (ours.loss, theirs.loss)
    assert (ours.grad_norm - theirs.grad_norm).abs().max() < 1e-5
    assert (ours.samples_seen == theirs.samples_seen).all()  # tensor-parallel ranks share, and are credited a share

    cfg, held = run.config, parallel.held(run)
    predicted = parallel.predicted_state(cfg)
    tensors = list(linear_gpt2(make_task(cfg, 1).build_model()).parameters())  # the most tensors a rank may have
    # no padding here (every shard is even), so parameters and gradients are exact. ZeRO-2's formula keeps the full
    # parameters; FSDP2 keeps them from forward to the end of backward, beside shards it keeps between steps
    params = held.peak_params - held.params if strategy == "zero2" else held.params
    assert params == predicted.params and held.grads == predicted.grads
    slack = 4 * len(tensors)  # AdamW keeps a 4-byte `step` per parameter tensor
    if strategy == "zero1":  # each tensor's state goes whole to one rank: a rank may be over by one tensor's
        slack += 8 * max(p.numel() for p in tensors)
    assert predicted.optimizer <= held.optimizer <= predicted.optimizer + slack
    counts = parallel.parameter_split(cfg)
    if strategy == "zero2":
        assert held.params == 4 * counts["total"] / 2
    if strategy == "fsdp":   # the shards plus one block and the root module gathered
        assert held.peak_params == held.params + 4 * (counts["block"] + counts["root"])
    # activations: what autograd kept, within 1% (the token ids and positions) of the formula for this GPT-2
    assert abs(held.activations / tpclaim.predicted_activations(cfg) - 1) < 0.01


def test_ddp_holds_the_baseline(ddp_runs):
    held, predicted = parallel.held(ddp_runs[2]), parallel.predicted_state(ddp_runs[2].config)
    assert held.params == predicted.params == held.peak_params and held.grads == predicted.grads
    assert 0 < held.optimizer - predicted.optimizer <= 4 * 28  # 28 parameter tensors, one 4-byte step each


def test_measured_activations_match_the_formula_with_this_models_counts(ddp_runs):
    for run in ddp_runs.values():   # the other strategies: in the test above
        cfg = run.config
        predicted = memory.activation_bytes(seq=cfg.seq_len, batch=cfg.global_batch // cfg.world_size, hidden=64,
                                            heads=4, layers=2, **parallel.GPT2_ON_CPU)
        assert abs(parallel.held(run).activations / predicted - 1) < 0.01


def test_only_the_first_steps_are_instrumented(runs_root, no_leftovers):
    run = labkit.launch(config("fsdp", 2, steps=COUNTED_STEPS + 2), runs_root=runs_root, echo=False, progress=False)
    df = run.df
    counted = df[df.step < COUNTED_STEPS]
    assert counted.allreduces.notna().all() and counted.param_bytes.notna().all()
    later = df[df.step >= COUNTED_STEPS]
    assert later.allreduces.isna().all() and later.param_bytes.isna().all()


# --- collectives -----------------------------------------------------------------------------------------------

def test_collectives_per_step_match_each_design(ddp_runs, runs_root, no_leftovers):
    kinds, runs = {}, {}
    for strategy, world in (("zero1", 2), ("zero2", 2), ("fsdp", 2), ("tp", 2)):
        runs[strategy] = labkit.launch(config(strategy, world, steps=COUNTED_STEPS), runs_root=runs_root, echo=False,
                                       progress=False)
        kinds[strategy] = parallel.collectives(runs[strategy])  # the last counted step: after DDP's bucket rebuild
    calls = {name: {kind: n for kind, (n, _) in found.items()} for name, found in kinds.items()}
    model_bytes = 4 * parallel.parameter_split(config("ddp", 2))["total"]
    assert parallel.collectives(ddp_runs[2]) == {"all_reduce": (1, model_bytes)}  # one bucket for the tiny model
    assert calls["zero1"] == {"all_reduce": 1, "broadcast": 28}  # then each parameter tensor from its owner
    # 3 FSDP groups (2 blocks + root), + the gradient norm's all-reduce; ZeRO-3 gathers again for backward
    assert calls["zero2"] == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 1}
    assert calls["fsdp"] == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 1}
    assert calls["tp"] == {"all_reduce": 2 * 2 * 2 + 1}
    # the ZeRO paper's traffic: stage 2 moves what DDP does, stage 3 one and a half times that
    table = parallel.collectives_table({"ddp": ddp_runs[2], **{k: v for k, v in runs.items()}})
    received = table[table.kind != "all_reduce"].groupby("run").bytes_received.sum()
    assert received["zero2"] == model_bytes and received["fsdp"] == 1.5 * model_bytes


def both_counters_on_ddp(ctx):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    from labkit.training.commhooks import install_comm_hook
    install_comm_hook(model, "allreduce")
    alone, _ = dist.new_subgroups(group_size=1)
    out = []
    for _ in range(3):
        with count_collectives() as python_side, DispatchCounter() as dispatcher:
            model(torch.ones(4, 8)).sum().backward()
            dist.all_reduce(torch.ones(5), group=alone)  # a group of one: reaches nobody, counted by neither
            out.append((python_side.take(), dispatcher.take(), dispatcher.take_kinds()))
    return out


def test_the_dispatch_counter_agrees_with_the_python_counter_on_ddp(runs_root, no_leftovers):
    run = labkit.launch(both_counters_on_ddp, world_size=2, runs_root=runs_root, echo=False, progress=False)
    python_side, dispatcher, kinds = run.result(0)[-1]  # after DDP's bucket rebuild (its step 1 broadcasts)
    assert python_side == dispatcher == (1, (8 * 8 + 8) * 4) and kinds == {"all_reduce": dispatcher}


# --- gradient accumulation under FSDP ------------------------------------------------------------------------------

@pytest.mark.parametrize("no_sync, reduce_scatters", [(True, 3), (False, 6)])
def test_fsdp_accumulation_reduces_once_per_step_with_no_sync(no_sync, reduce_scatters, ddp_runs, runs_root,
                                                               no_leftovers):
    run = labkit.launch(config("fsdp", 2, grad_accum=2, no_sync=no_sync), runs_root=runs_root, echo=False,
                        progress=False)
    assert parallel.collectives(run)["reduce_scatter"][0] == reduce_scatters
    ddp = ddp_runs[2].steps().set_index("step").loss
    assert (run.steps().set_index("step").loss - ddp).abs().max() < 1e-5


# --- the tensor-parallel adaptation, by hand -------------------------------------------------------------------------

def test_linear_gpt2_computes_the_same_function():
    cfg = RunConfig(world_size=1)
    torch.manual_seed(0)
    original = make_task(cfg).build_model()
    torch.manual_seed(0)
    adapted = linear_gpt2(make_task(cfg).build_model())
    inputs = make_task(cfg).batch(0, 0, 0)[0]
    assert torch.allclose(original(input_ids=inputs).logits, adapted(input_ids=inputs).logits, atol=1e-5)
    assert sum(p.numel() for p in original.parameters()) == sum(p.numel() for p in adapted.parameters())


def test_split_blocks_refuses_the_fused_qkv():
    class FakeMesh:
        def size(self):
            return 2
    with pytest.raises(TypeError, match="linear_gpt2"):
        split_blocks(make_task(RunConfig(world_size=1)).build_model(), FakeMesh())
    with pytest.raises(TypeError, match="not a transformers GPT-2"):
        linear_gpt2(torch.nn.Linear(2, 2))


# --- clipping over shards, and a model that is not GPT-2 --------------------------------------------------------------

@pytest.mark.parametrize("strategy, world", [("fsdp", 2), ("tp", 2), ("fsdp+tp", 4)])
def test_clipping_over_shards_matches_ddp(strategy, world, runs_root, no_leftovers):
    clipped = {name: labkit.launch(config(name, world, steps=3, clip_norm=0.5), runs_root=runs_root, echo=False,
                                   progress=False).steps().set_index("step")
               for name in ("ddp", strategy)}
    assert (clipped["ddp"].grad_norm > 0.5).all()  # the clipping is active on every step
    assert (clipped[strategy].loss - clipped["ddp"].loss).abs().max() < 1e-5


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_zero_strategies_train_the_digits_mlp_like_ddp(strategy, runs_root, no_leftovers):
    cfg = RunConfig(task="digits", world_size=2, steps=3, eval_every=3, grad_accum=2, tensorboard=False)
    runs = {s: labkit.launch(cfg.replace(strategy=s), runs_root=runs_root, echo=False, progress=False).steps()
            for s in ("ddp", strategy)}
    for column in ("loss", "eval_accuracy"):
        assert (runs[strategy][column] - runs["ddp"][column]).abs().max() < 1e-5


def test_the_meter_by_hand_and_it_unhooks_after_its_steps():
    from labkit.training.parallel.held import StateMeter
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    meter = StateMeter(model, optimizer, steps=2)
    psi = 10 * 20 + 20 + 20 + 1
    for step in range(3):
        model(torch.ones(8, 10)).sum().backward()
        optimizer.step()
        fields = meter.fields()
        optimizer.zero_grad()
        if step < 2:
            # fp32: 4 bytes per parameter and gradient, AdamW's two moments and a 4-byte step per tensor;
            # saved for backward: the input (8 x 10, for Linear 1's weight gradient) and ReLU's output (8 x 20,
            # which ReLU and Linear 2 both keep: one storage)
            assert fields["param_bytes"] == fields["grad_bytes"] == fields["peak_param_bytes"] == 4 * psi
            assert fields["optim_bytes"] == 8 * psi + 4 * 4
            assert fields["act_bytes"] == (8 * 10 + 8 * 20) * 4
        else:
            assert fields == {}
    assert not model._forward_hooks and not model._forward_pre_hooks and not optimizer._optimizer_step_post_hooks
