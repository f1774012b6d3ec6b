"""The DDP checker on real gloo ranks: the references pass it, each classic mistake is caught with its own message,
and the references agree with torch's DistributedDataParallel."""
import functools

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import exercises as ex
from labkit.exercises.checknet import build_checknet, check_batch, check_loss


@pytest.mark.parametrize("wrapper, options", [(ex.NaiveDDP, {}), (ex.OverlapDDP, {"overlap": True}),
                                              (ex.BucketedDDP, {"bucket_size_mb": 0.01})])
def test_each_reference_passes_its_checker_with_a_report_of_what_was_measured(wrapper, options, runs_root,
                                                                              no_leftovers):
    report = ex.check_ddp(wrapper, runs_root=runs_root, **options)
    assert report.ok, report.text()
    assert {f.check for f in report.findings} >= {"broadcast", "gradients", "traffic", "training", "overlap"}
    assert report.measured["bytes_ratio"] == 1.0 and abs(report.measured["grad_ratio"] - 1) < 1e-5
    assert report.measured["param_diff"] < 1e-5
    expected_overlap = 0.0 if wrapper is ex.NaiveDDP else 1.0
    assert report.measured["overlap_fraction"] == expected_overlap


def test_the_bucketed_reference_passes_on_four_ranks_and_says_they_are_oversubscribed(runs_root, no_leftovers):
    report = ex.check_ddp(ex.BucketedDDP, bucket_size_mb=0.01, world_size=4, runs_root=runs_root)
    assert report.ok, report.text()
    assert "4 gloo ranks" in report.subject
    assert ("oversubscribed" in report.subject) == (4 > (__import__("os").cpu_count() or 1))


# --- deliberately broken wrappers ------------------------------------------------------------------------------

class NoBroadcast(ex.NaiveDDP):
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.world_size = module, dist.get_world_size()


class TrainedOnlyBroadcast(ex.NaiveDDP):
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.world_size = module, dist.get_world_size()
        with torch.no_grad():
            for param in module.parameters():
                if param.requires_grad:
                    dist.broadcast(param, src=0)


class AveragedStart(ex.NaiveDDP):
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.world_size = module, dist.get_world_size()
        with torch.no_grad():
            for param in module.parameters():
                dist.all_reduce(param)
                param.div_(self.world_size)


class Summed(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)


class TiedTwice(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        for _, param in self.module.named_parameters(remove_duplicate=False):
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size)


class FrozenReduced(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
            param.grad.div_(self.world_size)


class BiasForgotten(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        for name, param in self.module.named_parameters():
            if param.grad is not None and not name.endswith("bias"):
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size)


class LaunchedLate(ex.OverlapDDP):
    def _launch(self, param):
        pass

    def finish_gradient_synchronization(self):
        handles = [dist.all_reduce(p.grad.div_(self.world_size), async_op=True)
                   for p in self.module.parameters() if p.grad is not None]
        for handle in handles:
            handle.wait()


class BlockingHook(ex.OverlapDDP):
    def _launch(self, param):
        param.grad.div_(self.world_size)
        dist.all_reduce(param.grad)


class NeverWaits(ex.OverlapDDP):
    def finish_gradient_synchronization(self):
        self._pending.clear()


class OnePerParameter(ex.OverlapDDP):
    def __init__(self, module, bucket_size_mb):
        super().__init__(module)


class Overflowing(ex.BucketedDDP):
    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb=1000.0)


class TiedTwiceInBuckets(ex.BucketedDDP):
    @staticmethod
    def _trained(module):
        return [p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]


class NotWrittenYet(torch.nn.Module):
    def __init__(self, module):
        raise NotImplementedError("NotWrittenYet.__init__ is not written yet")


class RaisesOnRank1(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        if dist.get_rank() == 1:
            raise ValueError("a bug on rank 1")
        super().finish_gradient_synchronization()


BROKEN = [
    (NoBroadcast, {}, "broadcast", "after construction rank 1's weights differ from rank 0's"),
    (TrainedOnlyBroadcast, {}, "broadcast", "frozen frozen.bias, frozen.weight (requires_grad=False) differs"),
    (AveragedStart, {}, "broadcast", "not on rank 0's initial weights"),
    (Summed, {}, "gradients", "gradients are summed, not averaged: rank 0's grad of embed.weight is 2.000×"),
    (TiedTwice, {}, "traffic", "tied weights were all-reduced 2 times per step: embed.weight = head.weight"),
    (FrozenReduced, {}, "traffic", "a parameter with requires_grad=False was all-reduced: frozen.weight"),
    (BiasForgotten, {}, "gradients", "blocks.0.bias was not averaged"),
    (LaunchedLate, {"overlap": True}, "overlap", "your all-reduces did not overlap backward: the first started"),
    (BlockingHook, {"overlap": True}, "overlap", "all-reduces per step ran with async_op=False inside backward"),
    (NeverWaits, {"overlap": True}, "waited", "were never waited for when finish_gradient_synchronization() returned"),
    (OnePerParameter, {"bucket_size_mb": 0.01}, "buckets", "7 all-reduces per step with bucket_size_mb=0.01"),
    (Overflowing, {"bucket_size_mb": 0.01}, "buckets", "an all-reduce carried 16,768 bytes with bucket_size_mb=0.01"),
    (TiedTwiceInBuckets, {"bucket_size_mb": 0.01}, "traffic", "tied weights were all-reduced twice: each step "
                                                              "carried 4,096 extra bytes"),
    (RaisesOnRank1, {}, "runs", "rank 1: your RaisesOnRank1.finish_gradient_synchronization raised ValueError at "
                                "step 0: a bug on rank 1"),
]


@pytest.mark.parametrize("wrapper, options, check, message", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_a_broken_wrapper_is_caught_with_its_specific_message(wrapper, options, check, message, runs_root,
                                                              no_leftovers):
    report = ex.check_ddp(wrapper, runs_root=runs_root, **options)
    assert not report.ok
    assert report.status(check) == "fail", report.text()
    assert any(message in f.message for f in report.findings if f.check == check), report.text()


def test_the_summed_gradient_ratio_is_measured_not_assumed(runs_root, no_leftovers):
    report = ex.check_ddp(Summed, runs_root=runs_root, world_size=4)
    assert "is 4.000× the single-process grad" in report.failures[0]
    assert abs(report.measured["grad_ratio"] - 4) < 1e-3


def test_naive_ddp_is_told_it_did_not_overlap_as_a_note_and_passes(runs_root, no_leftovers):
    report = ex.check_ddp(ex.NaiveDDP, runs_root=runs_root)
    assert report.status("overlap") == "note" and report.ok
    with_overlap = ex.check_ddp(ex.NaiveDDP, runs_root=runs_root, overlap=True)
    assert with_overlap.status("overlap") == "fail" and not with_overlap.ok


def test_a_wrapper_not_written_yet_is_reported_as_missing_not_as_a_crash(runs_root, no_leftovers, monkeypatch):
    report = ex.check_ddp(NotWrittenYet, runs_root=runs_root)
    assert report.missing and not report.failures
    assert ("NotWrittenYet.__init__ is not written yet (the NotWrittenYet.__init__ raised NotImplementedError)"
            in report.missing[0])
    # lessons ship their exercises as stubs: one not written yet hands back the reference, said, in any mode
    assert report.use(ex.NaiveDDP) is ex.NaiveDDP and "NOT WRITTEN YET" in report.text()
    monkeypatch.setenv("LABKIT_EXERCISES", "blank")
    assert report.use(ex.NaiveDDP) is ex.NaiveDDP


def test_a_wrapper_that_hangs_is_reported_in_time(runs_root, no_leftovers):
    class SkipsOnRank1(ex.NaiveDDP):
        def finish_gradient_synchronization(self):
            if dist.get_rank() == 0:
                super().finish_gradient_synchronization()

    report = ex.check_ddp(SkipsOnRank1, runs_root=runs_root, timeout=4)
    assert report.status("runs") == "fail" and "made no progress" in report.failures[0]
    assert "A collective that not every rank made" in report.failures[0]


# --- the references against torch's DDP ---------------------------------------------------------------------

def _against_torch_ddp(ctx, steps):
    """Each reference and torch DDP on the same CheckNet (from rank 0's seed) and data; largest differences."""
    wrappers = {"naive": ex.NaiveDDP, "overlap": ex.OverlapDDP,
                "bucketed": functools.partial(ex.BucketedDDP, bucket_size_mb=0.01),
                "torch": lambda m: torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.01)}
    models = {}
    for name, wrap in wrappers.items():
        model = build_checknet(1000 + ctx.rank)  # every wrapper, torch's too, must start all ranks from rank 0's
        models[name] = (model, wrap(model), torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                                lr=0.01))
    gaps = {"grad": 0.0, "param": 0.0}
    for step in range(steps):
        grads = {}
        for name, (model, wrapped, optimizer) in models.items():
            check_loss(wrapped, *check_batch(step, ctx.rank, ctx.world_size)).backward()
            if name != "torch":
                wrapped.finish_gradient_synchronization()
            grads[name] = [p.grad.clone() for p in model.parameters() if p.requires_grad]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for name in ("naive", "overlap", "bucketed"):
            gaps["grad"] = max(gaps["grad"], max((a - b).abs().max().item()
                                                 for a, b in zip(grads[name], grads["torch"])))
            gaps["param"] = max(gaps["param"], max((a - b).abs().max().item() for a, b in
                                                   zip(models[name][0].parameters(), models["torch"][0].parameters())))
    return gaps


def test_the_references_match_torch_ddp_gradients_and_parameters(runs_root, no_leftovers):
    run = labkit.launch(functools.partial(_against_torch_ddp, steps=4), world_size=2, runs_root=runs_root,
                        echo=False, progress=False)
    for rank in range(2):
        gaps = run.result(rank)
        assert gaps["grad"] < 1e-6 and gaps["param"] < 1e-6, gaps


def test_plan_buckets_fills_in_order_and_gives_an_oversized_tensor_its_own_bucket():
    assert ex.plan_buckets([400, 400, 900, 100], cap=1000) == [[0, 1], [2, 3]]
    assert ex.plan_buckets([2000, 10, 10], cap=1000) == [[0], [1, 2]]
    assert ex.plan_buckets([10, 2000, 10], cap=1000) == [[0], [1], [2]]
    assert ex.plan_buckets([], cap=1000) == []
    assert ex.plan_buckets([1, 1, 1], cap=1e9) == [[0, 1, 2]]


# --- the cases (46): the truth about wrong and correct-but-different wrappers ----------------------------

class LastBucketOnly(ex.BucketedDDP):
    """Waits only for the last bucket: its values depend on timing, so only the calls made can judge it."""

    def finish_gradient_synchronization(self):
        self.buckets[-1].work.wait()
        for bucket in self.buckets:
            offset = 0
            for param in bucket.params:
                param.grad.copy_(bucket.flat[offset:offset + param.numel()].view_as(param))
                offset += param.numel()
            bucket.ready, bucket.work = 0, None


def test_a_bucketed_ddp_that_waits_only_for_the_last_bucket_fails_on_the_calls_it_made(runs_root, no_leftovers):
    report = ex.check_ddp(LastBucketOnly, bucket_size_mb=0.01, runs_root=runs_root)
    assert report.status("waited") == "fail", report.text()
    assert report.blamed == ["LastBucketOnly.finish_gradient_synchronization"], report.text()
    assert "1 async collectives were never waited for when finish_gradient_synchronization() returned" \
           in report.failures[0]
    assert report.status("gradients") == "note"   # not judged on values that depend on timing


class SendRecvDDP(ex.NaiveDDP):
    """Correct, written another way: rank 0 gathers every gradient with recv, sums, averages and sends it back."""

    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is None:
                continue
            if dist.get_rank() == 0:
                total = param.grad.clone()
                for peer in range(1, self.world_size):
                    incoming = torch.empty_like(param.grad)
                    dist.recv(incoming, src=peer)
                    total += incoming
                param.grad.copy_(total / self.world_size)
                for peer in range(1, self.world_size):
                    dist.send(param.grad, dst=peer)
            else:
                dist.send(param.grad, dst=0)
                dist.recv(param.grad, src=0)


class ReduceBroadcastDDP(ex.NaiveDDP):
    """Correct, written another way: reduce to rank 0, divide there, broadcast back."""

    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is not None:
                dist.reduce(param.grad, dst=0)
                if dist.get_rank() == 0:
                    param.grad.div_(self.world_size)
                dist.broadcast(param.grad, src=0)


@pytest.mark.parametrize("wrapper, travelled", [(SendRecvDDP, "point-to-point calls (recv, send"),
                                                (ReduceBroadcastDDP, "travelled by broadcast, reduce")])
def test_correct_values_sent_with_other_collectives_pass_and_are_not_blamed_on_imports_or_tied_weights(
        wrapper, travelled, runs_root, no_leftovers):
    report = ex.check_ddp(wrapper, runs_root=runs_root)
    assert report.ok, report.text()
    said = report.text()
    assert travelled in said and "from torch.distributed import" not in said and "tied weights" not in said, said


def test_the_naive_and_bucketed_references_run_on_three_ranks(runs_root, no_leftovers):
    for wrapper, options in ((ex.NaiveDDP, {}), (ex.BucketedDDP, {"bucket_size_mb": 0.01})):
        report = ex.check_ddp(wrapper, world_size=3, runs_root=runs_root, **options)
        assert report.ok and "3 gloo ranks" in report.subject, report.text()


class DividedTwice(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size).div_(self.world_size)


class DividedNotSummed(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.div_(self.world_size)


class MaxNotSum(ex.NaiveDDP):
    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.MAX)
                param.grad.div_(self.world_size)


class HookedTwice(ex.OverlapDDP):
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.world_size, self._pending = module, dist.get_world_size(), []
        with torch.no_grad():
            for param in module.parameters():
                dist.broadcast(param, src=0)
        for param in module.parameters():
            if param.requires_grad:
                for _ in range(2):
                    param.register_post_accumulate_grad_hook(self.hook)

    def hook(self, param):
        self._launch(param)


class HalfSizedBuckets(ex.BucketedDDP):
    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb=bucket_size_mb / 2)


NAMED = [
    (DividedTwice, {}, "DividedTwice.finish_gradient_synchronization",
     "0.500× the single-process gradient: 1/2 of the average, which was divided by the world size (2) once more"),
    (DividedNotSummed, {}, "DividedNotSummed.finish_gradient_synchronization",
     "its own rows' gradient divided by the world size (2), never summed over the ranks"),
    (MaxNotSum, {}, "MaxNotSum.finish_gradient_synchronization", "the element-wise maximum over the ranks"),
    (HookedTwice, {"overlap": True}, "HookedTwice.__init__",
     "HookedTwice.hook was registered 2 times as a gradient hook"),
    (HalfSizedBuckets, {"bucket_size_mb": 0.01}, "HalfSizedBuckets.__init__",
     "so they fit one bucket"),
]


@pytest.mark.parametrize("wrapper, options, part, message", NAMED, ids=[n[0].__name__ for n in NAMED])
def test_a_wrong_wrapper_is_told_the_cause_and_the_function(wrapper, options, part, message, runs_root,
                                                            no_leftovers):
    report = ex.check_ddp(wrapper, runs_root=runs_root, **options)
    assert not report.ok and part in report.blamed, report.text()
    assert any(message in f.message for f in report.findings if f.status == "fail"), report.text()
