"""Counting what the ranks really sent: the collective counter, every hook on real gloo ranks, GradScaler's skips,
and each counted fact breaking when what was sent is broken on purpose."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import labkit
from labkit import Fault, RunConfig
from labkit.training import commhooks
from labkit.training.commhooks import count_collectives, payload_bytes, single_bucket_mb
from labkit.tricks import commeff

CFG = RunConfig(world_size=2, steps=4, tensorboard=False, save_final=False)
PARAMS = commeff.parameter_count(CFG)


def test_payload_is_dtype_itemsize_times_elements():
    assert payload_bytes(torch.zeros(10, dtype=torch.float16)) == 20
    assert payload_bytes([torch.zeros(3), torch.zeros(2, dtype=torch.float64)]) == 3 * 4 + 2 * 8


def test_single_bucket_holds_the_whole_model():
    model = torch.nn.Linear(1024, 1024)
    assert single_bucket_mb(model) > (1024 * 1024 + 1024) * 4 / 2**20


def collectives_of_every_kind(ctx):
    """Issue known collectives under a counter; what it counted after each group of calls."""
    seen = []
    with count_collectives() as wire:
        dist.all_reduce(torch.ones(10, dtype=torch.float16))
        dist.all_reduce(torch.ones(5), async_op=True).wait()
        seen.append(wire.take())
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))      # this rank's input: 4 floats
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=0)
        seen.append(wire.take())
        with wire.paused():
            dist.all_reduce(torch.ones(100))
        seen.append(wire.take())
        dist.all_gather_object([None, None], {"a": 1})                   # torch's own helpers are counted too
        seen.append(wire.take()[0] > 0)
    dist.all_reduce(torch.ones(7))                                        # after the block: not counted
    seen.append(wire.take())
    return seen


def test_the_counter_sees_each_collective_and_the_bytes_of_what_was_handed_to_it(runs_root, no_leftovers):
    run = labkit.launch(collectives_of_every_kind, world_size=2, runs_root=runs_root, echo=False, progress=False)
    for rank in range(2):
        assert run.result(rank) == [(2, 20 + 20), (2, 16 + 24), (0, 0), True, (0, 0)]


def single_rank_subgroups(ctx):
    subgroups, _ = dist.new_subgroups(group_size=1)
    with count_collectives() as wire:
        dist.all_reduce(torch.ones(10), group=subgroups)
        return wire.take()


def test_a_collective_within_a_group_of_one_reaches_nobody_and_is_not_counted(runs_root, no_leftovers):
    run = labkit.launch(single_rank_subgroups, world_size=2, runs_root=runs_root, echo=False, progress=False)
    assert run.result(0) == run.result(1) == (0, 0)


@pytest.fixture(scope="module")
def hook_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    runs = {hook: labkit.launch(CFG.replace(comm_hook=hook), runs_root=root, echo=False, progress=False)
            for hook in ("allreduce", "fp16", "bf16", "powersgd")}
    runs["powersgd r4"] = labkit.launch(CFG.replace(comm_hook="powersgd", powersgd_rank=4), runs_root=root,
                                        echo=False, progress=False)
    return runs


def test_every_hook_trains_and_its_collectives_and_bytes_are_counted(hook_runs):
    counted = {hook: commeff.steps(run)[["allreduces", "comm_bytes"]].values.tolist()
               for hook, run in hook_runs.items()}
    assert counted["allreduce"] == [[1, PARAMS * 4]] * 4
    assert counted["fp16"] == counted["bf16"] == [[1, PARAMS * 2]] * 4      # the tensors handed over are 16-bit
    shapes = commeff.gradient_shapes(CFG)
    for hook, rank in (("powersgd", 1), ("powersgd r4", 4)):
        # warm-up: the whole fp32 gradient in one all-reduce; then uncompressed rest, P and Q: three collectives
        assert counted[hook] == [[1, PARAMS * 4]] * 2 + [[3, commeff.powersgd_payload(shapes, rank)]] * 2
    for run in hook_runs.values():
        assert run.steps()["loss"].iloc[-1] < run.steps()["loss"].iloc[0]


def sends_fp32(state, bucket):  # unannotated on purpose: DDP checks a hook's annotations
    """A hook registered as "fp16" (or "powersgd") that sends the full fp32 bucket."""
    return default_hooks.allreduce_hook(None, bucket)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_a_compression_hook_that_sends_fp32_fails_lesson_04s_byte_asserts(hook, runs_root, monkeypatch):
    monkeypatch.setitem(commhooks.HOOKS, hook, sends_fp32)   # the ranks fork from here, and inherit it
    run = labkit.launch(CFG.replace(comm_hook=hook), runs_root=runs_root, echo=False, progress=False)
    sent = commeff.steps(run)["comm_bytes"]
    assert (sent == PARAMS * 4).all()                          # what the counter saw: fp32, all of it
    if hook == "powersgd":
        assert not (sent.iloc[commeff.WARM:] < PARAMS * 4 / 5).all()   # lesson 04: "under a fifth of fp32"
    else:
        assert not (sent / PARAMS == 2).all()                  # lesson 04: "2 bytes per gradient element"


def test_no_sync_all_reduces_once_per_step_and_the_naive_way_every_micro_batch(runs_root):
    base = RunConfig(world_size=2, global_batch=32, grad_accum=4, steps=3, tensorboard=False)
    synced = labkit.launch(base, runs_root=runs_root, echo=False)
    naive = labkit.launch(base.replace(no_sync=False), runs_root=runs_root, echo=False)
    assert synced.df["allreduces"].tolist() == [1] * 6 and naive.df["allreduces"].tolist() == [4] * 6
    assert naive.df["comm_bytes"].tolist() == [4 * PARAMS * 4] * 6
    assert synced.df["samples"].tolist() == naive.df["samples"].tolist() == [16] * 6   # rows that went through
    # Same update either way: the gradients are averaged once, or four times over partial sums.
    assert naive.steps()["loss"].tolist() == pytest.approx(synced.steps()["loss"].tolist(), abs=1e-5)


def test_no_sync_that_does_nothing_fails_lesson_04s_count_assert(runs_root, monkeypatch):
    from torch.nn.parallel import DistributedDataParallel
    monkeypatch.setattr(DistributedDataParallel, "no_sync", lambda self: torch.enable_grad())
    run = labkit.launch(RunConfig(world_size=2, global_batch=32, grad_accum=4, steps=2, tensorboard=False),
                        runs_root=runs_root, echo=False)
    assert not (commeff.steps(run)["allreduces"] == 1).all()   # lesson 04: "no_sync(): exactly one per step"


def test_a_one_rank_run_sends_nothing(runs_root):
    run = labkit.launch(CFG.replace(world_size=1, steps=2), runs_root=runs_root, echo=False)
    assert run.df["allreduces"].tolist() == run.df["comm_bytes"].tolist() == [0, 0]


def test_fp16_records_the_loss_scale_and_the_step_grad_scaler_skipped(runs_root):
    cfg = CFG.replace(precision="fp16", steps=5, nan_policy="ignore", faults=(Fault(kind="nan", rank=1, step=2),))
    s = commeff.steps(labkit.launch(cfg, runs_root=runs_root, echo=False))
    assert s["skipped_step"].tolist() == [0, 0, 1, 0, 0]            # the NaN reached both ranks' gradients
    assert s["loss_scale"].tolist() == [2.0**16] * 3 + [2.0**15] * 2  # and the scale halved after it
    plain = commeff.steps(labkit.launch(CFG.replace(steps=2), runs_root=runs_root, echo=False))
    assert plain["skipped_step"].tolist() == [0, 0] and plain["loss_scale"].tolist() == [1.0, 1.0]


def test_a_scaler_that_never_skips_fails_the_skip_record(runs_root, monkeypatch):
    # A GradScaler whose step always calls the optimizer: the NaN step is taken, and the record says so.
    monkeypatch.setattr(torch.amp.GradScaler, "step", lambda self, optimizer, *a, **k: optimizer.step())
    cfg = CFG.replace(precision="fp16", steps=3, nan_policy="ignore", faults=(Fault(kind="nan", rank=1, step=1),))
    s = commeff.steps(labkit.launch(cfg, runs_root=runs_root, echo=False))
    assert s["skipped_step"].tolist() == [0, 0, 0]


def test_a_batch_over_the_memory_budget_fails_with_the_advice_to_accumulate(runs_root, no_leftovers):
    cfg = RunConfig(world_size=2, global_batch=1024, steps=2, memory_budget_mb=20, tensorboard=False)
    with pytest.raises(labkit.RankFailure) as info:
        labkit.launch(cfg, runs_root=runs_root, echo=False)
    assert "OutOfMemoryBudget" in info.value.detail and "grad_accum=2" in info.value.detail
    labkit.launch(cfg.replace(memory_budget_mb=None), runs_root=runs_root, echo=False)  # the same run, no budget
