"""The seeding exercise's checker (lesson 08): the reference passes on 2 ranks run twice, a correct
seeding written another way passes, and each classic mistake fails naming its cause and the
learner's function."""
from __future__ import annotations

import random

import numpy as np
import torch

from labkit.exercises.checks_seeds import check_seeding, seeded_build
from labkit.training.seeding import seed_everything


def test_the_reference_passes(runs_root, no_leftovers):
    report = check_seeding(seeded_build, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) is seeded_build
    passed = {f.check for f in report.findings if f.status == "pass"}
    assert passed == {"repeats", "weights", "noise", "seed"}, report.text()


def by_hand(seed, rank, make_model):
    """Correct another way: each generator seeded by hand, per rank with seed * 1000 + rank + 1."""
    torch.manual_seed(seed)
    model = make_model()
    for seeder in (torch.manual_seed, np.random.seed, random.seed):
        seeder(seed * 1000 + rank + 1)
    return model


def test_a_seeding_by_hand_passes(runs_root, no_leftovers):
    report = check_seeding(by_hand, runs_root=runs_root)
    assert report.ok, report.text()


def one_seed_everywhere(seed, rank, make_model):
    seed_everything(seed)
    return make_model()


def rank_seed_before_building(seed, rank, make_model):
    seed_everything(seed, rank=rank)
    return make_model()


def no_seed(seed, rank, make_model):
    return make_model()


def rank_zero_seeded(seed, rank, make_model):
    if rank == 0:
        seed_everything(seed)
    model = make_model()
    seed_everything(seed, rank=rank)
    return model


def torch_only(seed, rank, make_model):
    torch.manual_seed(seed)
    model = make_model()
    torch.manual_seed(seed + rank + 1)
    return model


def constant_seed(seed, rank, make_model):
    return seeded_build(1234, rank, make_model)


def test_each_classic_mistake_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, words in [
            (one_seed_everywhere, ["ranks 0 and 1 draw the same dropout masks",
                                   "one seed everywhere"]),
            (rank_seed_before_building, ["rank 1's initial weights differ from rank 0's",
                                         "depends on the rank"]),
            (no_seed, ["other initial weights on every rank", "nothing seeds torch"]),
            (rank_zero_seeded, ["rank 1 built other initial weights",
                                "only some ranks are seeded"]),
            (torch_only, ["ranks 0 and 1 other NumPy draws", "np.random.seed",
                          "Python random draws"]),
            (constant_seed, ["seed argument is not used"])]:
        report = check_seeding(fn, runs_root=runs_root)
        text = report.text()
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, text)
        assert all(w in text for w in words), (fn.__name__, text)


def test_the_stub_is_not_written_yet_and_a_non_model_is_named(runs_root, no_leftovers):
    def build_for_rank(seed, rank, make_model):
        raise NotImplementedError("build_for_rank is not written yet")

    report = check_seeding(build_for_rank, runs_root=runs_root)
    assert not report.ok and report.missing and not report.failures, report.text()
    assert "build_for_rank is not written yet" in report.text()
    assert report.use(seeded_build) is seeded_build

    def returns_nothing(seed, rank, make_model):
        seed_everything(seed)
        make_model()

    report = check_seeding(returns_nothing, runs_root=runs_root)
    assert report.blamed == ["returns_nothing"], report.text()
    assert "returned a NoneType" in report.text(), report.text()
