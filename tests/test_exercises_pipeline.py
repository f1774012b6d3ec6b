"""The pipeline exercise's checker on real gloo ranks: the reference passes; each typical mistake is caught with
its own message (a deadlock bounded and named, gradients not accumulated, the loss not divided by m, GPipe's
order, a received activation without requires_grad), each blamed on the learner's function and on the stage and
step that makes it (stage 0's or stage 1's forward or backward, the sends and receives); a hang names the learner's
line; a correct schedule written another way passes."""
from __future__ import annotations

from pathlib import Path

import torch

from labkit.exercises import check_pipeline, one_f_one_b


def recv_first(stage, wire):
    """Stage 0 waits for a gradient before sending anything: both stages receive, a deadlock."""
    if stage.rank == 0:
        wire.recv()   # the line a hang must name
    one_f_one_b(stage, wire)


def stage1_wrong_microbatch(stage, wire):
    """Stage 1 runs forward(i, x) with the wrong i: microbatch 0's activation against microbatch 3's targets."""
    if stage.rank == 0:
        return one_f_one_b(stage, wire)
    for i in reversed(range(stage.m)):
        x = wire.recv().requires_grad_()
        (stage.forward(i, x) / stage.m).backward()
        wire.send(x.grad)


def stage0_swapped_backwards(stage, wire):
    """Stage 0 backpropagates the second gradient into the first microbatch's output (and the other way)."""
    if stage.rank == 1:
        return one_f_one_b(stage, wire)
    outputs = [stage.forward(i) for i in range(2)]
    for out in outputs:
        wire.send(out)
    grads = [wire.recv(), wire.recv()]
    outputs[0].backward(grads[1])
    outputs[1].backward(grads[0])
    for i in range(2, stage.m):
        out = stage.forward(i)
        wire.send(out)
        out.backward(wire.recv())


def sends_twice(stage, wire):
    """Stage 0 sends microbatch 0's activation twice: stage 1 takes the copy for microbatch 1 (no hang)."""
    if stage.rank == 1:
        return one_f_one_b(stage, wire)
    outputs = {i: stage.forward(i) for i in range(2)}
    wire.send(outputs[0])
    wire.send(outputs[0])
    wire.send(outputs[1])
    for i in range(stage.m):
        outputs.pop(i).backward(wire.recv())
        if i + 2 < stage.m:
            outputs[i + 2] = stage.forward(i + 2)
            wire.send(outputs[i + 2])


def receives_one_more(stage, wire):
    """Stage 1 waits for a fifth activation that stage 0 never sends: a hang, explained by the counts."""
    one_f_one_b(stage, wire)
    if stage.rank == 1:
        wire.recv()


def one_at_a_time(stage, wire):
    """Correct, written another way: one microbatch in flight, the loss scaled through backward's argument."""
    for i in range(stage.m):
        if stage.rank == 0:
            out = stage.forward(i)
            wire.send(out)
            torch.autograd.backward(out, wire.recv())
        else:
            x = wire.recv().requires_grad_()
            stage.forward(i, x).backward(torch.tensor(1.0 / stage.m))
            wire.send(x.grad)


def not_divided(stage, wire):
    if stage.rank == 0:
        return one_f_one_b(stage, wire)
    for i in range(stage.m):
        x = wire.recv().requires_grad_()
        stage.forward(i, x).backward()
        wire.send(x.grad)


def not_accumulated(stage, wire):
    if stage.rank == 1:
        return one_f_one_b(stage, wire)
    outputs = {i: stage.forward(i) for i in range(2)}
    for i in outputs:
        wire.send(outputs[i])
    for i in range(stage.m):
        stage.module.zero_grad()  # the mistake: each microbatch's gradient replaces the one before
        outputs.pop(i).backward(wire.recv())
        if i + 2 < stage.m:
            outputs[i + 2] = stage.forward(i + 2)
            wire.send(outputs[i + 2])


def gpipe(stage, wire):
    if stage.rank == 1:
        return one_f_one_b(stage, wire)
    outputs = [stage.forward(i) for i in range(stage.m)]
    for out in outputs:
        wire.send(out)
    for out in outputs:
        out.backward(wire.recv())


def no_requires_grad(stage, wire):
    if stage.rank == 0:
        return one_f_one_b(stage, wire)
    for i in range(stage.m):
        x = wire.recv()
        (stage.forward(i, x) / stage.m).backward()
        wire.send(x.grad)


def test_the_reference_passes(tmp_path):
    report = check_pipeline(one_f_one_b, runs_root=tmp_path)
    assert report.ok, report.text()
    assert report.measured["most_held"] == 2 and report.measured["grad_rel_diff"] < 1e-5


def test_each_typical_mistake_has_its_own_message(tmp_path):
    deadlock = check_pipeline(recv_first, timeout=4, runs_root=tmp_path)
    assert not deadlock.ok and "deadlock: stage 0: waiting in recv #1 for a gradient" in deadlock.text()
    assert "stage 1: waiting in recv #1 for an activation" in deadlock.text()
    assert "4x the unsplit model's: divide each microbatch's loss" in check_pipeline(not_divided).text()
    assert "gradients were not accumulated" in check_pipeline(not_accumulated, runs_root=tmp_path).text()
    order = check_pipeline(gpipe, runs_root=tmp_path)
    assert order.status("gradients") == "pass" and "that is GPipe's order" in order.text()
    missing = check_pipeline(no_requires_grad, runs_root=tmp_path)
    assert "requires_grad_() before forward" in missing.text()
    for report, fn in [(deadlock, recv_first), (order, gpipe), (missing, no_requires_grad)]:
        assert report.blamed == [fn.__name__], report.text()


def test_a_wrong_stage_or_step_is_named(tmp_path):
    for fn, check, words in [
            (stage1_wrong_microbatch, "stage 1 forward", "stage 1's forward(3, x) got microbatch 0's activation"),
            (stage0_swapped_backwards, "stage 0 backward",
             "stage 0's backward of microbatch 0 got microbatch 1's gradient"),
            (sends_twice, "stage 1 forward", "stage 1's forward(1, x) got microbatch 0's activation"),
            (not_divided, "gradients", "4x the unsplit model's: divide each microbatch's loss")]:
        report = check_pipeline(fn, runs_root=tmp_path)
        failed = [f for f in report.findings if f.status == "fail"]
        assert failed and failed[0].check == check and words in failed[0].message, report.text()
        assert report.blamed == [fn.__name__], report.text()
    twice = check_pipeline(sends_twice, runs_root=tmp_path)
    assert "stage 0 sent 5 activations and stage 1 received 4 (m = 4)" in twice.text(), twice.text()
    assert twice.status("stage 0 backward") is None and twice.status("in flight") is None


def test_a_hang_names_the_learners_line_and_what_each_stage_waited_for(tmp_path):
    deadlock = check_pipeline(recv_first, timeout=4, runs_root=tmp_path)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "the line a hang" in text)
    assert f"test_exercises_pipeline.py:{line} in recv_first" in deadlock.text(), deadlock.text()
    assert "context.py" not in deadlock.text() and "probe.py" not in deadlock.text()
    extra = check_pipeline(receives_one_more, timeout=4, runs_root=tmp_path)
    assert extra.status("sends and receives") == "fail" and extra.blamed == ["receives_one_more"], extra.text()
    assert "stage 1 waits for an activation stage 0 never sent" in extra.text(), extra.text()


def test_a_correct_schedule_written_another_way_passes(tmp_path):
    report = check_pipeline(one_at_a_time, runs_root=tmp_path)
    assert report.ok and report.measured["most_held"] == 1, report.text()
