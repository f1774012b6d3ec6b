"""The pipeline exercise's checker on real gloo ranks: the reference passes; each typical mistake is caught with
its own message (a deadlock bounded and named, gradients not accumulated, the loss not divided by m, GPipe's
order, a received activation without requires_grad)."""
from __future__ import annotations

from labkit.exercises import check_pipeline, one_f_one_b


def recv_first(stage, wire):
    """Stage 0 waits for a gradient before sending anything: both stages receive, a deadlock."""
    if stage.rank == 0:
        wire.recv()
    one_f_one_b(stage, wire)


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
