import math

import torch

from labkit import RunConfig
from labkit.training.tasks import make_task, successor_table


def _global_batch(cfg, step):
    """Concatenate every rank's micro-batches in the order they tile the global batch."""
    task = make_task(cfg)
    parts = [task.batch(step, m, r) for m in range(cfg.grad_accum) for r in range(cfg.world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_tinylm_global_batch_does_not_depend_on_how_it_is_split():
    base = RunConfig(task="tinylm", world_size=1, global_batch=16)
    for world, accum in [(2, 1), (4, 1), (2, 2), (1, 4)]:
        other = base.replace(world_size=world, grad_accum=accum)
        for step in (0, 3):
            a, b = _global_batch(base, step), _global_batch(other, step)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_tinylm_sentences_follow_the_language_and_the_floor_is_ln_k():
    cfg = RunConfig(task="tinylm", world_size=1, global_batch=8, vocab_size=32, branching=3, seq_len=16)
    task = make_task(cfg)
    inputs, targets = task.batch(0, 0, 0)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    table = successor_table(32, 3)
    allowed = (table[inputs] == targets.unsqueeze(-1)).any(-1)
    assert allowed.all()
    assert task.loss_floor == math.log(3)


def test_different_steps_and_seeds_give_different_data():
    cfg = RunConfig(task="tinylm", world_size=1, global_batch=8)
    task = make_task(cfg)
    assert not torch.equal(task.batch(0, 0, 0)[0], task.batch(1, 0, 0)[0])
    other = make_task(cfg.replace(seed=1))
    assert not torch.equal(task.batch(0, 0, 0)[0], other.batch(0, 0, 0)[0])


def test_digits_global_batch_does_not_depend_on_the_split_and_covers_an_epoch():
    base = RunConfig(task="digits", world_size=1, global_batch=32)
    a = _global_batch(base, 5)
    b = _global_batch(base.replace(world_size=4, grad_accum=2), 5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    task = make_task(base.replace(global_batch=479))  # 3 steps of 479 = one epoch of 1437 images
    seen = torch.cat([task.batch(s, 0, 0)[0] for s in range(3)])
    assert torch.unique(seen, dim=0).shape[0] == torch.unique(task.x_train, dim=0).shape[0]


def test_models_run_forward():
    for name in ("tinylm", "digits"):
        cfg = RunConfig(task=name, world_size=1, global_batch=4)
        task = make_task(cfg)
        loss, extras = task.loss(task.build_model(), *task.batch(0, 0, 0))
        assert loss.ndim == 0 and math.isfinite(loss.item())
