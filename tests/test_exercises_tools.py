"""The exercises' tools: the collective probe, the report and blank mode, blank copies of a lesson, the walk that
finds optimizer state, the timing harness and the figures."""
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from matplotlib.figure import Figure

import labkit
from labkit import exercises as ex
from labkit.exercises import blanks, charts, speeds
from labkit.exercises.probe import CommProbe
from labkit.training.tasks import make_task

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LESSONS = ["16_build_ddp_yourself.ipynb", "17_build_zero_yourself.ipynb"]


def _probe_rank(ctx):
    original = dist.all_reduce
    tensor = torch.ones(256)
    with CommProbe() as probe:
        with probe.phase("sync", step=3):
            dist.all_reduce(tensor)
            handle = dist.all_reduce(torch.ones(16), async_op=True)
            handle.wait()
            forgotten = dist.all_reduce(torch.ones(8), async_op=True)
        with probe.paused():
            dist.broadcast(torch.ones(4), src=0)
        dist.broadcast(torch.ones(2, 3), src=0)
    waited = [e["waited"] for e in probe.events]
    forgotten.wait()
    restored = dist.all_reduce is original and torch.distributed.distributed_c10d.all_reduce is original
    return {"events": probe.events, "waited": waited, "restored": restored, "ptr": tensor.data_ptr()}


def test_the_probe_sees_each_collective_with_its_bytes_timing_and_waits_then_restores_torch(runs_root,
                                                                                              no_leftovers):
    run = labkit.launch(_probe_rank, world_size=2, runs_root=runs_root, echo=False, progress=False)
    out = run.result(0)
    events = out["events"]
    assert out["restored"]
    assert [(e["op"], e["bytes"], e["async_op"], e["phase"], e["step"]) for e in events] == [
        ("all_reduce", 1024, False, "sync", 3), ("all_reduce", 64, True, "sync", 3),
        ("all_reduce", 32, True, "sync", 3), ("broadcast", 24, False, "", -1)]  # the paused broadcast is not there
    assert events[0]["ptr"] == out["ptr"] and events[0]["end"] >= events[0]["start"]
    assert out["waited"] == [False, True, False, False]
    assert events[1]["end"] is not None and events[1]["end"] >= events[1]["start"]


def test_a_report_is_ok_only_without_failures_or_missing_parts_and_blank_mode_hands_back_the_reference(monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    report = ex.Report("Mine on 2 ranks", implementation="mine")
    report.add("broadcast", "pass", "fine")
    report.add("overlap", "note", "nothing overlapped")
    assert report.ok and report.use("reference") == "mine" and "PASSED" in report.text()
    report.add("gradients", "fail", "gradients are summed")
    assert not report.ok and report.failures == ["gradients are summed"] and report.status("gradients") == "fail"
    with pytest.raises(ex.ExerciseFailed, match="gradients are summed"):
        report.use("reference")
    monkeypatch.setenv("LABKIT_EXERCISES", "blank")
    assert ex.blank_mode() and report.use("reference") == "reference"
    with pytest.raises(ValueError, match="status = 'bad'"):
        ex.Finding("x", "bad", "y")


def test_a_blank_body_keeps_signatures_and_docstrings_and_names_what_is_missing():
    source = '''# ✏️ EXERCISE
class Wrapper(torch.nn.Module):
    """A wrapper."""

    def __init__(self, module, size=1.0):
        """Keep it."""
        super().__init__()
        self.module = module  # the solution

    def forward(self, x):
        return self.module(x)
'''
    blank = blanks.blank_source(source)
    assert "def __init__(self, module, size=1.0):" in blank and '"""Keep it."""' in blank
    assert "self.module = module" not in blank and "super().__init__()" not in blank
    namespace = {"torch": torch}
    exec(compile(blank, "<blank>", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="Wrapper.__init__ is not written yet"):
        namespace["Wrapper"](None)
    with pytest.raises(NotImplementedError, match="Wrapper.forward is not written yet"):
        namespace["Wrapper"].forward(None, 1)


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_blank_copy_of_a_lesson_empties_exactly_its_exercise_cells_and_switches_to_blank_mode(lesson, tmp_path):
    original = json.loads((NOTEBOOKS / lesson).read_text())
    out = blanks.blank_copy(NOTEBOOKS / lesson, tmp_path / lesson)
    copy = json.loads(out.read_text())
    assert copy["cells"][0]["cell_type"] == "code" and "LABKIT_EXERCISES" in "".join(copy["cells"][0]["source"])
    pairs = list(zip(original["cells"], copy["cells"][1:]))
    assert len(pairs) == len(original["cells"]) == len(copy["cells"]) - 1
    exercises = [(a, b) for a, b in pairs if blanks.is_exercise(a)]
    assert exercises
    for before, after in pairs:
        if blanks.is_exercise(before):
            text = "".join(after["source"])
            compile(text, lesson, "exec")
            assert "NotImplementedError" in text and "dist.all_reduce" not in text and "broadcast(" not in text
        else:
            assert before["source"] == after["source"]


def test_a_blank_body_whose_raise_would_pass_100_columns_is_wrapped():
    solution = ("class MyBucketedDataParallel:\n"
                "    def finish_gradient_synchronization(self):\n"
                "        return 1\n")
    stub = blanks.blank_source(solution)
    assert "raise NotImplementedError(\n" in stub and max(map(len, stub.splitlines())) <= 100, stub
    with pytest.raises(NotImplementedError, match="finish_gradient_synchronization is not written"):
        namespace: dict = {}
        exec(stub, namespace)
        namespace["MyBucketedDataParallel"]().finish_gradient_synchronization()


def test_blank_copy_refuses_a_notebook_without_exercises(tmp_path):
    with pytest.raises(ValueError, match="no exercise cells"):
        blanks.blank_copy(NOTEBOOKS / "15_playground.ipynb", tmp_path / "x.ipynb")


def test_state_holdings_counts_adam_state_but_not_parameters_or_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    frozen = model[1].bias
    frozen.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert ex.state_holdings(optimizer, model.parameters()).bytes == 0
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    held = ex.state_holdings(optimizer, model.parameters())
    trained = [p for p in model.parameters() if p.requires_grad]
    assert held.bytes == sum(8 * p.numel() + 4 for p in trained)  # exp_avg, exp_avg_sq, and a float32 step
    assert held.owned == (0, 1, 2) and held.owned_elements == sum(p.numel() for p in trained)


def test_time_wrappers_records_each_wrapper_and_the_figures_draw(runs_root, no_leftovers):
    run = speeds.time_wrappers({"naive": ex.NaiveDDP, "torch": speeds.TorchDDP}, steps=3, model_size="tiny",
                               runs_root=runs_root)
    table = speeds.timing_table(run, warm=1)
    assert list(table.index) == ["naive", "torch"]
    assert table.loc["naive", "allreduces"] == 28 and table.loc["naive", "overlap_fraction"] == 0
    assert table.loc["torch", "overlap_fraction"] == 1 and speeds.loss_gap(run, "torch") < 1e-6
    assert isinstance(charts.timeline(run), Figure)
    sweep = pd.DataFrame({"implementation": ["a", "a", "b"], "bucket_mb": [0.1, 1.0, 1.0], "step ms": [3.0, 2.0, 2.5],
                          "allreduces": [10, 2, 2]})
    assert isinstance(charts.bucket_sweep(sweep, baselines={"naive": (5.0, 28)}), Figure)
    rows = pd.DataFrame({"optimizer": ["x", "x", "x"], "world_size": [1, 2, 2], "rank": [0, 0, 1],
                         "state_bytes": [800, 400, 400], "oversubscribed": [False, False, False]})
    assert isinstance(charts.state_per_rank(rows, {1: 800, 2: 400}), Figure)


def test_packing_problems_pass_tight_buckets_and_name_wasted_or_oversized_messages():
    assert speeds.packing_problems([900, 800, 950, 300], cap=1000, largest_gradient=500) == []
    split = speeds.packing_problems([400, 300, 950], cap=1000, largest_gradient=500)   # two that fit in one
    assert split == ["messages 0 and 1 (400 + 300 B) would have fit in one bucket of 1,000 B"]
    assert speeds.packing_problems([1200, 900], cap=1000, largest_gradient=500)[0].startswith("message 0 carries")
    assert speeds.packing_problems([1200, 900], cap=1000, largest_gradient=1200) == []   # one gradient, too big


def test_lesson_16s_message_claims_on_counted_messages_and_a_wasteful_wrapper_caught(runs_root, no_leftovers):
    """Lesson 16's claims 1 and 2, on the messages the probe counted, with the lesson's labkit functions; broken on
    purpose: one message per gradient, judged as 1 MB buckets, wastes messages and is named."""
    import functools
    cap_mb = 0.05
    run = speeds.time_wrappers({"yours": functools.partial(ex.BucketedDDP, bucket_size_mb=cap_mb),
                                "torch": functools.partial(speeds.TorchDDP, bucket_size_mb=cap_mb),
                                "one per gradient": ex.NaiveDDP}, steps=4, runs_root=runs_root)
    trained = [p for p in make_task(speeds.tinylm_config(2)).build_model().parameters()
               if p.requires_grad]
    largest_gradient, model_bytes = max(p.numel() * 4 for p in trained), sum(p.numel() * 4 for p in trained)
    for step, sent in speeds.messages(run, "yours").items():
        assert sum(sent) == model_bytes and not speeds.packing_problems(sent, cap_mb * 2**20, largest_gradient)
    wasted = speeds.messages(run, "one per gradient")[2]
    assert len(wasted) == len(trained)
    assert any("would have fit in one bucket" in p for p in speeds.packing_problems(wasted, 2**20, largest_gradient))
    first = run.df[(run.df.label == "torch") & (run.df.step_of == 0)].allreduces.unique().tolist()
    assert first == [1]                                              # torch's DDP: one message at step 0
    torch_sent = speeds.messages(run, "torch")[2]
    assert cap_mb * 2**20 < max(torch_sent) <= cap_mb * 2**20 + largest_gradient   # a little over the cap
    assert len(torch_sent) < len(speeds.messages(run, "yours")[2])                # so fewer messages than yours
    with pytest.raises(KeyError, match="no steps of 'nobody'"):
        speeds.messages(run, "nobody")


def test_the_bucket_sweeps_claim_functions_hold_on_a_tight_sweep_and_fail_on_a_broken_one():
    """Lesson 16's sweep claims (speeds.*), each returning (holds, measured), on hand-made messages: a sweep that
    holds, then the same sweep broken one way per claim."""
    cap = 2**20   # 1 MB
    timeline = lambda sizes: [(i, i + 1, b) for i, b in enumerate(sizes)]   # noqa: E731 - (launch, done, bytes)
    run = type("Run", (), {})()
    run.df = pd.DataFrame([{"label": "yours 1.0 MB", "step_of": s, "rank": 0, "timeline": timeline([cap, cap // 2])}
                           for s in (2, 3)])
    assert speeds.sends_each_byte_once(run, (1.0,), cap + cap // 2)[0]
    assert speeds.packs_tightly(run, (1.0,), largest_gradient=cap // 4)[0]
    assert not speeds.sends_each_byte_once(run, (1.0,), cap)[0]              # the tied weight sent twice, say
    run.df.timeline = [timeline([cap // 4, cap // 4, cap])] * 2               # two that fit in one bucket
    holds, measured = speeds.packs_tightly(run, (1.0,), largest_gradient=cap // 4)
    assert not holds and "would have fit in one bucket" in measured

    sweep = pd.DataFrame({"implementation": ["yours"] * 3 + ["torch DDP"] * 3, "bucket_mb": [0.05, 1.0, 4.0] * 2,
                          "allreduces": [30, 4, 1, 17, 4, 1],
                          "largest message (KiB)": [100, 1100, 3000, 250, 1030, 3000]})
    assert speeds.fewer_messages_as_buckets_grow(sweep, "yours")[0]
    assert speeds.torch_overshoots_by_under_a_gradient(sweep, (0.05, 1.0, 4.0), 3000 * 2**10, 300 * 2**10)[0]
    assert not speeds.torch_overshoots_by_under_a_gradient(sweep, (0.05, 1.0, 4.0), 3000 * 2**10, 10 * 2**10)[0]
    sweep.loc[2, "allreduces"] = 2                                            # never down to one message
    assert not speeds.fewer_messages_as_buckets_grow(sweep, "yours")[0]
