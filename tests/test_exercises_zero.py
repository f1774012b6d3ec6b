"""The sharded-optimizer checker on real gloo ranks: the reference (and torch's ZeroRedundancyOptimizer) pass it,
classic mistakes are caught with their own message, the reference trains exactly like ZeroRedundancyOptimizer,
and optimizer state per rank is measured against the ZeRO-1 formula."""
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import labkit
from labkit import exercises as ex
from labkit import memory
from labkit.exercises import zero_runs
from labkit.exercises.checknet import build_checknet, check_batch, check_loss


class TorchZero(ZeroRedundancyOptimizer):
    """torch's ZeroRedundancyOptimizer behind the exercise's interface."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_class=optimizer_cls, **kwargs)


@pytest.mark.parametrize("sharded, world_size", [(ex.ShardedOptimizer, 2), (ex.ShardedOptimizer, 4), (TorchZero, 2)])
def test_the_reference_and_torch_zero_pass_the_checker(sharded, world_size, runs_root, no_leftovers):
    report = ex.check_sharded_optimizer(sharded, world_size=world_size, runs_root=runs_root)
    assert report.ok, report.text()
    fractions = report.measured["state_fraction"]
    assert abs(sum(fractions) - 1) < 1e-9 and sum(report.measured["state_bytes"]) == report.measured["unsharded_bytes"]
    assert report.measured["param_diff"] < 1e-5


def test_the_reference_shards_evenly_and_the_state_matches_the_formula(runs_root, no_leftovers):
    report = ex.check_sharded_optimizer(ex.ShardedOptimizer, world_size=2, runs_root=runs_root)
    formula = report.measured["formula_bytes"]
    assert all(abs(b - formula) / formula < 0.02 for b in report.measured["state_bytes"]), report.text()
    assert 8 <= report.measured["k"] < 8.1  # AdamW in fp32: two 4-byte tensors per parameter, plus step counters


def test_sgd_without_momentum_keeps_no_state_and_the_checker_says_so(runs_root, no_leftovers):
    report = ex.check_sharded_optimizer(ex.ShardedOptimizer, torch.optim.SGD, {"lr": 0.1}, runs_root=runs_root)
    assert report.ok and report.status("state") == "note", report.text()
    momentum = ex.check_sharded_optimizer(ex.ShardedOptimizer, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9},
                                          runs_root=runs_root)
    assert momentum.ok and 4 <= momentum.measured["k"] < 4.1


# --- deliberately broken optimizers -----------------------------------------------------------------------------

class Unsharded(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        super().__init__(params, defaults=dict(kwargs))
        self.inner = optimizer_cls(params, **kwargs)

    def step(self, closure=None):
        return self.inner.step(closure)


class NeverSends(ex.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        return self.local.step() if self.local is not None else None


class DropsKwargs(ex.ShardedOptimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls)


class SameShardEverywhere(ex.ShardedOptimizer):
    """Owners decided by position without the rank: ranks 0 and 1 both step the first half of each group."""

    def add_param_group(self, param_group):
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        trained = [p for p in group["params"] if p.requires_grad]
        half = (len(trained) + 1) // 2
        for i, param in enumerate(trained):
            self.owner[id(param)] = 0 if i < half else 1
        if trained:
            local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": trained[:half]}
            if self.local is None:
                self.local = self.optimizer_cls([local_group], **self.optimizer_kwargs)
            else:
                self.local.add_param_group(local_group)
            self._local_group[len(self.param_groups) - 1] = len(self.local.param_groups) - 1


class DeafToParamGroups(ex.ShardedOptimizer):
    """The ✏️ solution's old step(): steps the local optimizer without passing param_groups' settings on."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.local.step(closure) if self.local is not None else None
        for param in (p for group in self.param_groups for p in group["params"]):
            if id(param) in self.owner:
                dist.broadcast(param, src=self.owner[id(param)])
        return loss


class PlannedShards(ex.ShardedOptimizer):
    """Owners from a fixed plan over the trained parameters in the order they come (weights, then biases)."""

    PLAN = ()

    def add_param_group(self, param_group):
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        mine = []
        for param in (p for p in group["params"] if p.requires_grad):
            self.owner[id(param)] = owner = self.PLAN[len(self.owner)]
            if owner == self.rank:
                mine.append(param)
        if mine:
            local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
            if self.local is None:
                self.local = self.optimizer_cls([local_group], **self.optimizer_kwargs)
            else:
                self.local.add_param_group(local_group)
            self._local_group[len(self.param_groups) - 1] = len(self.local.param_groups) - 1


class Shards73To27(PlannedShards):
    """The issue's case: three of the four 1024-element weights on rank 0 (73%), one and the biases on rank 1."""

    PLAN = (0, 0, 0, 1, 1, 1, 1)


class OneRankHolds2Percent(PlannedShards):
    """The issue's case on 4 ranks: rank 3 holds only the three biases (2% of the parameters)."""

    PLAN = (0, 0, 1, 2, 3, 3, 3)


class DropsGroupSettings(ex.ShardedOptimizer):
    """Builds the local optimizer from the constructor's kwargs alone: the biases' weight_decay=0.0 is lost."""

    def add_param_group(self, param_group):
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        mine = []
        for param in sorted((p for p in group["params"] if p.requires_grad), key=lambda p: -p.numel()):
            owner = min(range(self.world_size), key=lambda r: self._elements[r])
            self._elements[owner] += param.numel()
            self.owner[id(param)] = owner
            if owner == self.rank:
                mine.append(param)
        if mine:
            if self.local is None:
                self.local = self.optimizer_cls(mine, **self.optimizer_kwargs)
            else:
                self.local.add_param_group({"params": mine})

    @torch.no_grad()
    def step(self, closure=None):
        self.local.step()
        for param in (p for group in self.param_groups for p in group["params"]):
            if id(param) in self.owner:
                dist.broadcast(param, src=self.owner[id(param)])


class NotWrittenYet(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        raise NotImplementedError("NotWrittenYet.__init__ is not written yet")


BROKEN = [
    (Unsharded, "state", "optimizer state on rank 1 holds 100% of the parameters, expected about 50%"),
    (NeverSends, "agreement", "after step 0 rank 1's parameters differ from rank 0's"),
    (DropsKwargs, "matches", "your first step moved them 0.10× as far as that optimizer does"),
    (SameShardEverywhere, "state", "has optimizer state on ranks 0, 1: each parameter's state belongs on one rank"),
    (DeafToParamGroups, "matches", "the lr set on param_groups before each step (as an LR scheduler does) did not "
                                   "reach the optimizer that steps"),
]


@pytest.mark.parametrize("sharded, check, message", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_a_broken_sharded_optimizer_is_caught_with_its_specific_message(sharded, check, message, runs_root,
                                                                        no_leftovers):
    report = ex.check_sharded_optimizer(sharded, runs_root=runs_root)
    assert not report.ok
    assert report.status(check) == "fail", report.text()
    assert any(message in f.message for f in report.findings if f.check == check), report.text()


def test_the_owner_of_a_parameter_that_was_not_sent_is_named(runs_root, no_leftovers):
    report = ex.check_sharded_optimizer(NeverSends, runs_root=runs_root)
    assert "its optimizer state is on rank" in report.failures[0]
    assert report.status("matches") == "note"  # not compared: the ranks disagree


@pytest.mark.parametrize("sharded, world_size, shares", [(Shards73To27, 2, "rank 0 73%, rank 1 27%"),
                                                          (OneRankHolds2Percent, 4, "rank 3 2%")])
def test_unbalanced_shards_that_fit_one_over_n_plus_the_largest_tensor_fail(sharded, world_size, shares, runs_root,
                                                                             no_leftovers):
    """The issue's cases: 73%/27% on 2 ranks (1/2 + the largest tensor, 24%, is 74%) and 2% on one of 4 ranks are
    unbalanced: the fullest rank holds more than the emptiest by more than its own largest tensor."""
    report = ex.check_sharded_optimizer(sharded, world_size=world_size, runs_root=runs_root)
    assert report.status("state") == "fail" and report.status("matches") == "pass", report.text()
    assert report.blamed == ["PlannedShards.add_param_group"], report.text()   # where the owners are decided
    said = report.failures[0]
    assert "the shards are unbalanced" in said and shares in said and "would even them" in said, said


def test_the_reference_passes_on_three_ranks(runs_root, no_leftovers):
    report = ex.check_sharded_optimizer(ex.ShardedOptimizer, world_size=3, runs_root=runs_root)
    assert report.ok, report.text()


def test_a_group_s_own_settings_lost_is_named_with_the_function_that_built_the_local_optimizer(runs_root,
                                                                                              no_leftovers):
    report = ex.check_sharded_optimizer(DropsGroupSettings, runs_root=runs_root)
    assert report.status("matches") == "fail", report.text()
    assert report.blamed == ["DropsGroupSettings.add_param_group"], report.text()
    assert "had weight_decay=0.1, where your param_groups say weight_decay=0.0" in report.failures[0]


def test_a_sharded_optimizer_not_written_yet_is_missing_not_failed(runs_root, no_leftovers):
    report = ex.check_sharded_optimizer(NotWrittenYet, runs_root=runs_root)
    assert report.missing and not report.failures and not report.ok


# --- the reference against torch's ZeroRedundancyOptimizer ------------------------------------------------------

def _against_torch_zero(ctx, steps):
    """The reference and ZeroRedundancyOptimizer over AdamW on the same model and gradients: largest difference."""
    models = {name: build_checknet(7) for name in ("ours", "torch")}
    optimizers = {"ours": ex.ShardedOptimizer(models["ours"].parameters(), torch.optim.AdamW, lr=0.01,
                                              weight_decay=0.1),
                  "torch": ZeroRedundancyOptimizer(models["torch"].parameters(), optimizer_class=torch.optim.AdamW,
                                                   lr=0.01, weight_decay=0.1)}
    for step in range(steps):
        for name, model in models.items():
            check_loss(model, *check_batch(step, ctx.rank, ctx.world_size)).backward()
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad.div_(ctx.world_size)
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
    return max((a - b).abs().max().item() for a, b in zip(models["ours"].parameters(), models["torch"].parameters()))


def test_the_reference_matches_zero_redundancy_optimizer(runs_root, no_leftovers):
    run = labkit.launch(functools.partial(_against_torch_zero, steps=5), world_size=2, runs_root=runs_root,
                        echo=False, progress=False)
    assert max(run.result(r) for r in range(2)) < 1e-6


def test_the_reference_trains_tinylm_like_zero_redundancy_optimizer(runs_root, no_leftovers):
    factories = {"ours": lambda ps: ex.ShardedOptimizer(ps, torch.optim.AdamW, lr=3e-3),
                 "torch": lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=3e-3)}
    runs = {name: zero_runs.train_run(f, name=name, steps=4, model_size="tiny", runs_root=runs_root)
            for name, f in factories.items()}
    ours, theirs = (runs[n].steps().loss.to_numpy() for n in ("ours", "torch"))
    assert len(ours) == 4 and abs(ours - theirs).max() < 1e-6


def test_state_per_rank_is_measured_against_the_formula_at_one_and_two_ranks(runs_root, no_leftovers):
    rows = zero_runs.measure_state({"plain": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                    "ours": lambda ps: ex.ShardedOptimizer(ps, torch.optim.AdamW, lr=1e-3)},
                                   world_sizes=(1, 2), model_size="tiny", runs_root=runs_root)
    psi = int(rows.params.iloc[0])
    plain, ours = rows[rows.optimizer == "plain"], rows[rows.optimizer == "ours"]
    assert (plain.state_bytes >= 8 * psi).all() and (plain.state_bytes - 8 * psi < 8 * 28).all()  # 28 tensors
    two = ours[ours.world_size == 2]
    assert two.state_bytes.sum() == plain.state_bytes.iloc[0]
    formula = memory.state_breakdown(psi, stage=1, dp=2, param_bytes=4, grad_bytes=4, k=8).optimizer
    assert two.state_bytes.max() >= formula and two.state_bytes.max() < 1.2 * formula
