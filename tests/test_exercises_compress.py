"""The compression hook exercise's checker (lesson 26): the reference and a bf16 hook pass on 2 gloo
ranks; each classic mistake fails naming its cause and the learner's hook; a stub is "not written
yet"; a hang is reported."""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.exercises.checks_compress import check_compression_hook, fp16_hook


def test_the_reference_passes(runs_root, no_leftovers):
    report = check_compression_hook(fp16_hook, runs_root=runs_root)
    assert report.ok, report.text()
    assert report.measured["bytes_per_element"] == 2.0 and report.measured["error"] < 0.01
    assert report.use(None) is fp16_hook


def _hook(bucket, *, dtype=torch.float16, divide=True, cast_back=True, copy_back=True, unwrap=True):
    buffer = bucket.buffer()
    compressed = buffer.to(dtype)
    if divide:
        compressed.div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def back(fut):
        value = fut.value()[0] if unwrap else fut.value()
        if not cast_back:
            return value
        if copy_back:
            buffer.copy_(value)
        return buffer
    return future.then(back)


def bf16_after_the_sum(state, bucket):
    """Correct written another way: bf16, divided after the all-reduce."""
    buffer = bucket.buffer()
    future = dist.all_reduce(buffer.to(torch.bfloat16), async_op=True).get_future()
    return future.then(lambda fut: buffer.copy_(fut.value()[0]).div_(2))


def test_a_bf16_hook_dividing_after_the_sum_passes(runs_root, no_leftovers):
    report = check_compression_hook(bf16_after_the_sum, runs_root=runs_root)
    assert report.ok, report.text()


def not_compressed(state, bucket):
    return _hook(bucket, dtype=torch.float32)


def not_divided(state, bucket):
    return _hook(bucket, divide=False)


def not_cast_back(state, bucket):
    return _hook(bucket, cast_back=False)


def never_copied_back(state, bucket):
    return _hook(bucket, copy_back=False)


def future_of_a_list(state, bucket):
    return _hook(bucket, unwrap=False, cast_back=False)


def returns_nothing(state, bucket):
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    buffer.div_(2)


def test_each_classic_mistake_is_named_with_the_learners_hook(runs_root, no_leftovers):
    for fn, words in [(not_compressed, "2.000x the fp16 hook's 2: not compressed"),
                      (not_divided, "gradients are 2.000x the mean: all_reduce sums"),
                      (not_cast_back, "not cast back: your hook's future value is float16"),
                      (never_copied_back, "this rank's own, not the mean"),
                      (future_of_a_list, "value is a list of 1 tensor(s), not one tensor"),
                      (returns_nothing, "returned NoneType, not a torch.futures.Future")]:
        report = check_compression_hook(fn, runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def my_fp16_hook(process_group, bucket):
    raise NotImplementedError("my_fp16_hook is not written yet")


def test_the_stub_is_not_written_yet_and_use_hands_back_the_reference(runs_root, no_leftovers,
                                                                      monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    report = check_compression_hook(my_fp16_hook, runs_root=runs_root)
    assert not report.failures and report.missing
    assert "my_fp16_hook is not written yet" in report.text()
    assert report.use(fp16_hook) is fp16_hook


def rank_one_skips(state, bucket):
    """Rank 1 never all-reduces its buckets: rank 0 waits for it."""
    if dist.get_rank() == 1:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    return _hook(bucket)


def test_a_hook_only_one_rank_all_reduces_in_is_reported_as_a_hang(runs_root, no_leftovers):
    report = check_compression_hook(rank_one_skips, timeout=4, runs_root=runs_root)
    text = report.text()
    assert not report.ok and "made no progress" in text, text
    assert "all-reduce each bucket once" in text, text


def test_hook_bytes_runs_the_reference_on_a_configs_model(runs_root, no_leftovers, monkeypatch):
    """What lesson 26 does with the hook that passed: DDP on its model, 2 bytes per element."""
    from labkit import RunConfig, make_task
    from labkit.exercises.checks_compress import hook_bytes
    monkeypatch.setenv("LABKIT_RUNS", str(runs_root))
    config = RunConfig(task="digits", world_size=2, global_batch=16)
    params = sum(p.numel() for p in make_task(config).build_model().parameters())
    assert hook_bytes(fp16_hook, config) == [2 * params, 2 * params]
