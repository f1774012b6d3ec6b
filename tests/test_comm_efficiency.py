"""What lesson 04 asserts that tests/test_commhooks.py does not: accumulation arithmetic and bytes, what autocast
changes (activations) and does not (gradients on the wire), GradScaler's skip-and-halve on CPU, PowerSGD's payload on
the tiny GPT-2, and torch's bf16 hook refusing gloo."""
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import labkit
from labkit import RunConfig
from labkit.train.commhooks import powersgd_bytes
from labkit.train.tasks import make_task


@pytest.mark.parametrize("accum", [1, 2, 4, 8])
def test_accumulation_splits_the_same_global_batch_into_micro_batches(accum):
    cfg = RunConfig.per_rank(batch_per_rank=16 // accum, world_size=2, grad_accum=accum)
    assert cfg.global_batch == 32 == cfg.world_size * cfg.batch_per_rank * cfg.grad_accum
    task, whole = make_task(cfg), make_task(cfg.replace(world_size=1, grad_accum=1))
    # Every (micro-batch, rank) slice, in order, rebuilds exactly the batch one rank would take in one go.
    parts = torch.cat([task.batch(5, micro, rank)[0] for micro in range(accum) for rank in range(2)])
    assert torch.equal(parts, whole.batch(5, 0, 0)[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    base = RunConfig(world_size=2, global_batch=16, steps=2, tensorboard=False, save_final=False)
    configs = {"naive x2": base.replace(grad_accum=2, no_sync=False), "no_sync x2": base.replace(grad_accum=2),
               "fp32": base, "bf16": base.replace(precision="bf16")}
    return {name: labkit.launch(cfg, runs_root=root, echo=False, progress=False) for name, cfg in configs.items()}


def fp32_gradient_bytes():
    return 4 * sum(p.numel() for p in make_task(RunConfig(world_size=2)).build_model().parameters())


def test_naive_accumulation_sends_accum_times_the_bytes_for_the_same_global_batch(runs):
    grad = fp32_gradient_bytes()
    assert runs["naive x2"].df["comm_bytes"].tolist() == [2 * grad] * 4  # 2 steps x 2 ranks
    assert runs["no_sync x2"].df["comm_bytes"].tolist() == [grad] * 4
    for name in ("naive x2", "no_sync x2"):
        assert runs[name].df.groupby("step")["samples"].sum().tolist() == [16, 16]


def test_accumulating_with_no_sync_is_the_same_update_as_one_big_batch(runs):
    assert runs["no_sync x2"].steps()["loss"].tolist() == pytest.approx(runs["fp32"].steps()["loss"].tolist(), abs=1e-5)


def test_powersgd_sends_less_at_a_lower_rank_and_far_less_than_fp32_on_the_tiny_gpt2():
    grads = [p.detach() for p in make_task(RunConfig(world_size=2)).build_model().parameters()]
    full = powersgd_bytes(grads, 1, compressing=False)
    assert full == fp32_gradient_bytes()
    assert powersgd_bytes(grads, 1) < full / 20 and powersgd_bytes(grads, 1) < powersgd_bytes(grads, 4) < full / 5


def try_torch_bf16_hook(ctx):
    ddp = DDP(torch.nn.Linear(4, 4))
    try:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        ddp(torch.randn(2, 4)).sum().backward()
        return "ran"
    except Exception as exc:  # noqa: BLE001 - what it raises is the point
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is a CPU/gloo fact")
def test_torchs_bf16_compress_hook_refuses_gloo_on_cpu(runs_root):
    outcome = labkit.launch(try_torch_bf16_hook, world_size=1, runs_root=runs_root, echo=False,
                            progress=False).result(0)
    assert outcome != "ran" and "NCCL" in outcome


def test_autocast_keeps_gradients_fp32_so_the_wire_bytes_do_not_change(runs):
    assert runs["bf16"].df["comm_bytes"].tolist() == runs["fp32"].df["comm_bytes"].tolist() == [fp32_gradient_bytes()] * 4
    assert runs["bf16"].steps()["loss"].tolist() == pytest.approx(runs["fp32"].steps()["loss"].tolist(), abs=0.02)


def test_autocast_halves_a_layers_output_and_shrinks_what_backward_keeps():
    task = make_task(RunConfig(world_size=1, global_batch=8))
    torch.manual_seed(0)
    model = task.build_model()
    inputs, targets = task.batch(0, 0, 0)
    measured = {}
    for name, enabled in (("fp32", False), ("bf16", True)):
        outputs, saved = [], {}

        def pack(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor
        handle = model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, out: outputs.append(out))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss, _ = task.loss(model, inputs, targets)
        loss.backward()
        handle.remove()
        measured[name] = (outputs[0].dtype, outputs[0].element_size(), sum(saved.values()))
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        model.zero_grad(set_to_none=True)
    assert measured["fp32"][:2] == (torch.float32, 4) and measured["bf16"][:2] == (torch.bfloat16, 2)
    assert 0.4 < measured["bf16"][2] / measured["fp32"][2] < 0.75


def scaled_fp16_step(init_scale, growth_interval=2000):
    """One fp16 autocast step of a tiny linear model through a CPU GradScaler: (weights changed, scale after)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(2, 8)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return changed, scaler.get_scale()


def test_grad_scaler_on_cpu_skips_an_overflowing_step_and_halves_the_scale():
    changed, scale = scaled_fp16_step(2.0**30)  # 2**30 x a gradient of 1 does not fit fp16 (max 65504): inf
    assert not changed and scale == 2.0**29


def test_grad_scaler_on_cpu_steps_when_finite_and_grows_after_growth_interval():
    changed, scale = scaled_fp16_step(2.0, growth_interval=1)
    assert changed and scale == 4.0
