"""The exact-resume exercise's checker (lesson 13): the reference save and load pass on 2 gloo
ranks; each classic mistake (a piece of state left out or not put back, the data position lost, the
model loaded on rank 0 only) fails naming it and the learner's function; a stub is "not written
yet"; a collective inside a rank-0-only save is reported as a hang."""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from labkit.exercises.checks_resume import check_resume, load_state, save_state


def test_the_reference_passes(runs_root, no_leftovers):
    report = check_resume(save_state, load_state, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.use(None) == (save_state, load_state)


def _save(path, model, opt, sched, epoch, step, *, leave_out=()):
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "torch": torch.get_rng_state(),
             "numpy": np.random.get_state(), "python": random.getstate(), "epoch": epoch,
             "step": step}
    for key in leave_out:
        del state[key]
    torch.save(state, path)


def _load(path, model, opt, sched, *, skip=(), position=None, only_rank0=()):
    state = torch.load(path, weights_only=False)
    put = {"model": lambda v: model.load_state_dict(v), "optimizer": opt.load_state_dict,
           "scheduler": sched.load_state_dict, "torch": torch.set_rng_state,
           "numpy": np.random.set_state, "python": random.setstate}
    for key, setter in put.items():
        if key in state and key not in skip and not (key in only_rank0 and dist.get_rank() != 0):
            setter(state[key])
    return position or (state["epoch"], state["step"])


def saves_all(path, model, opt, sched, epoch, step):
    _save(path, model, opt, sched, epoch, step)


def test_a_correct_pair_of_another_layout_passes(runs_root, no_leftovers):
    """Flat keys, no atomic rename: still every piece saved and put back."""
    report = check_resume(saves_all, loads_what_is_there, runs_root=runs_root)
    assert report.ok, report.text()


def no_optimizer_saved(path, model, opt, sched, epoch, step):
    _save(path, model, opt, sched, epoch, step, leave_out=("optimizer",))


def loads_what_is_there(path, model, opt, sched):
    return _load(path, model, opt, sched)


def rng_not_restored(path, model, opt, sched):
    return _load(path, model, opt, sched, skip=("torch",))


def position_lost(path, model, opt, sched):
    return _load(path, model, opt, sched, position=(0, 0))


def model_on_rank0_only(path, model, opt, sched):
    return _load(path, model, opt, sched, only_rank0=("model",))


def test_each_classic_mistake_is_named_with_the_learners_function(runs_root, no_leftovers):
    for save, load, words, blamed in [  # (save, load, words of the report, the function blamed)
            (no_optimizer_saved, loads_what_is_there,
             "the optimizer's state (AdamW's exp_avg and exp_avg_sq", "save_state"),
            (saves_all, rng_not_restored,
             "torch's RNG stream (the dropout masks) was not restored", "load_state"),
            (save_state, position_lost,
             "resumed at epoch 0, step 0, not at epoch 1, step 6", "load_state"),
            (saves_all, model_on_rank0_only,
             "rank 1's weights at step 6 are not what it saved (rank 0's are)", "load_state")]:
        report = check_resume(save, load, runs_root=runs_root)
        assert not report.ok and report.blamed == [blamed], (load.__name__, report.text())
        assert words in report.text(), (save.__name__, load.__name__, report.text())


def test_the_optimizer_mistake_says_where_the_loss_parts(runs_root, no_leftovers):
    report = check_resume(no_optimizer_saved, loads_what_is_there, runs_root=runs_root)
    text = report.text()
    assert "your save_state left it out of the file" in text and "parts at step 7" in text, text
    assert "resumed losses part from the straight run's at step 7" in text, text


def my_save(path, model, opt, sched, epoch, step):
    raise NotImplementedError("save_state is not written yet")


def my_load(path, model, opt, sched):
    raise NotImplementedError("load_state is not written yet")


def test_the_stub_is_not_written_yet_and_use_hands_back_the_reference(runs_root, no_leftovers,
                                                                      monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    report = check_resume(my_save, my_load, runs_root=runs_root)
    assert not report.failures and "save_state is not written yet" in report.text(), report.text()
    assert report.use((save_state, load_state)) == (save_state, load_state)


def barrier_on_rank0(path, model, opt, sched, epoch, step):
    """A rank-0-only save that waits for the others: they never come."""
    if dist.get_rank() == 0:
        save_state(path, model, opt, sched, epoch, step)
        dist.barrier()
    else:
        save_state(path, model, opt, sched, epoch, step)


def test_a_collective_in_a_rank0_only_save_is_reported_as_a_hang(runs_root, no_leftovers):
    report = check_resume(barrier_on_rank0, load_state, timeout=4, runs_root=runs_root)
    text = report.text()
    assert not report.ok and "made no progress" in text and "barrier_on_rank0" in text, text
    assert "must not hold a collective" in text, text
