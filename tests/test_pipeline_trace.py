"""A pipeline step under torch.profiler (RunConfig.profile_step): real gloo ranks write their Chrome traces, the
reader finds torch's own action labels in them, and the match with labkit's timed actions holds, and fails when an
action is dropped, two are swapped, or one is moved outside torch's span of it."""
from __future__ import annotations

import copy
import json
import math

import pytest

import labkit
from labkit import ConfigError, RunConfig
from labkit.tricks import pipeline as pp

STEPS = 4   # steps 0..2 count messages at the dispatcher; the profiled step is the first after them


def small(schedule: str, v: int = 1, **fields) -> RunConfig:
    base = dict(strategy="pp", world_size=2, layers=4, global_batch=16, microbatches=4, pipeline_schedule=schedule,
                stages_per_rank=v, steps=STEPS, profile_step=STEPS - 1, tensorboard=False, save_final=False)
    return RunConfig(**{**base, **fields})


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    return labkit.launch(small("Interleaved1F1B", 2), echo=False, progress=False,
                         runs_root=tmp_path_factory.mktemp("traced"))


def test_each_rank_writes_a_chrome_trace_of_the_profiled_step(interleaved):
    for rank in range(2):
        data = json.loads(interleaved.dir.trace(rank).read_text())
        assert data["distributedInfo"]["rank"] == rank
        trace = pp.read_stage_trace(interleaved.dir.trace(rank))
        # 4 microbatches through 2 stages per rank: 8 forwards and 8 backwards, each labelled "PP:<stage><kind><mb>"
        assert sorted(trace.actions.kind.value_counts().items()) == [("B", 8), ("F", 8)]
        assert set(trace.actions.stage) == ({0, 2} if rank == 0 else {1, 3})
        assert set(trace.messages.kind) <= {"SEND_F", "RECV_F", "SEND_B", "RECV_B"} and len(trace.messages) > 0
        assert len(trace.receives) > 0 and (trace.receives.bytes > 0).all()
        table = trace.table()
        assert table.start_ms.iloc[0] == 0 and table.start_ms.is_monotonic_increasing and (table.ms > 0).all()


def test_the_trace_holds_labkits_actions_in_the_same_order_inside_torchs_spans(interleaved):
    actions = pp.step_actions(interleaved, STEPS - 1)
    for rank in range(2):
        holds, measured = pp.match_stage_trace(pp.read_stage_trace(interleaved.dir.trace(rank)), actions[rank])
        assert holds, measured
        assert "16 actions on both, the same in the same order" in measured


def test_the_match_fails_on_a_dropped_a_swapped_or_a_moved_action(interleaved):
    trace = pp.read_stage_trace(interleaved.dir.trace(0))
    actions = sorted(pp.step_actions(interleaved, STEPS - 1)[0], key=lambda a: a[3])
    dropped = actions[:5] + actions[6:]
    assert pp.match_stage_trace(trace, dropped) == (False, "the trace holds 16 compute actions, labkit timed 15")
    swapped = copy.deepcopy(actions)
    swapped[3][:3], swapped[4][:3] = actions[4][:3], actions[3][:3]   # their names swapped, their times kept
    holds, measured = pp.match_stage_trace(trace, swapped)
    assert not holds and "differ in order" in measured
    moved = copy.deepcopy(actions)
    moved[7][4] = actions[8][4]      # the 8th action ends when the 9th did: past torch's span, the order kept
    holds, measured = pp.match_stage_trace(trace, moved)
    assert not holds and "no one clock offset" in measured


def test_the_timeline_draws_every_rank_from_its_trace(interleaved):
    fig = pp.trace_timeline(interleaved)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == [f"rank {r} · {what}" for r in (0, 1) for what in ("torch.profiler", "gloo:recv",
                                                                          "labkit's records")]


def test_gpipe_labels_its_microbatches_and_1f1b_labels_nothing(tmp_path):
    gpipe = labkit.launch(small("GPipe"), echo=False, progress=False, runs_root=tmp_path)
    for rank in range(2):
        trace = pp.read_stage_trace(gpipe.dir.trace(rank))
        assert list(trace.actions.label) == [f"Forward {i}" for i in range(4)] + [f"Backward {i}" for i in range(4)]
        holds, measured = pp.match_stage_trace(trace, pp.step_actions(gpipe, STEPS - 1)[rank])
        assert holds, measured
    one = labkit.launch(small("1F1B"), echo=False, progress=False, runs_root=tmp_path)
    trace = pp.read_stage_trace(one.dir.trace(0))
    assert trace.actions.empty and len(trace.receives) > 0     # operators and gloo's messages, no action labels
    assert pp.match_stage_trace(trace, pp.step_actions(one, STEPS - 1)[0])[0] is False
    with pytest.raises(ValueError, match="Schedule1F1B records none"):
        pp.trace_timeline(one)


def test_profile_step_is_validated_and_only_that_run_writes_traces(tmp_path):
    with pytest.raises(ConfigError, match=r"profile_step = 4: the run has steps 0 to 3"):
        RunConfig(steps=4, profile_step=4).validate()
    with pytest.raises(ConfigError, match=r"RunConfig.profile_step = -1"):
        RunConfig(profile_step=-1).validate()
    plain = labkit.launch(RunConfig(world_size=2, steps=2, tensorboard=False, save_final=False), echo=False,
                          progress=False, runs_root=tmp_path)
    assert not plain.dir.trace(0).exists()
    traced = labkit.launch(RunConfig(world_size=2, steps=2, profile_step=1, tensorboard=False, save_final=False),
                           echo=False, progress=False, runs_root=tmp_path)
    names = {e.get("name") for e in json.loads(traced.dir.trace(1).read_text())["traceEvents"]}
    assert "Optimizer.step#AdamW.step" in names and any(str(n).startswith("gloo:all_reduce") for n in names)


def test_the_reader_splits_dualpipev_pairs_and_reads_gloos_bytes(tmp_path):
    """A hand-written trace in torch 2.13's format: a paired action is two actions sharing the pair's span, in the
    order torch runs them; message actions and operators are kept apart from compute."""
    events = [{"ph": "X", "name": "PP:0F0", "ts": 1000.0, "dur": 50.0},
              {"ph": "X", "name": "PP:0SEND_F0", "ts": 1060.0, "dur": 5.0},
              {"ph": "X", "name": "gloo:recv", "ts": 1070.0, "dur": 20.0,
               "args": {"Input Dims": [[2, 32, 64]], "Input type": ["float"]}},
              {"ph": "X", "name": "PP:(3F1;0B0)OVERLAP_F_B", "ts": 1100.0, "dur": 80.0},
              {"ph": "X", "name": "aten::mm", "ts": 1110.0, "dur": 3.0},
              {"ph": "X", "name": "PP:0UNSHARD", "ts": 990.0, "dur": 1.0}]
    path = tmp_path / "trace0.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0}}))
    trace = pp.read_stage_trace(path)
    assert trace.rank == 0
    assert [tuple(r) for r in trace.actions[["kind", "stage", "microbatch"]].itertuples(index=False)] == [
        ("F", 0, 0), ("F", 3, 1), ("B", 0, 0)]
    assert trace.actions.start_s.tolist()[1:] == [1100e-6, 1100e-6]
    assert trace.messages.label.tolist() == ["PP:0SEND_F0"] and trace.receives.bytes.tolist() == [2 * 32 * 64 * 4]
    ours = [["F", 0, 0, 5.0, 5.00004, 0], ["F", 3, 1, 5.0001, 5.00013, 0], ["B", 0, 0, 5.00014, 5.000175, 0]]
    holds, measured = pp.match_stage_trace(trace, ours)
    assert holds and "3 actions on both" in measured and "of torch's spans" in measured
    late = [ours[0], ours[1], ["B", 0, 0, 5.00014, 5.0006, 0]]   # ends 0.4 ms after the pair's span closed
    assert pp.match_stage_trace(trace, late)[0] is False


def test_an_events_bytes_come_from_its_shapes_and_dtype():
    from labkit.tricks.trace_events import event_bytes, event_elements
    assert event_bytes({"args": {"Input Dims": [[2, 32, 64]], "Input type": ["float"]}}) == 2 * 32 * 64 * 4
    assert event_elements({"args": {"Input Dims": [[[8, 64], [64]]]}}) == 8 * 64 + 64      # a tensor list
    assert event_bytes({"args": {"Input Dims": [[8]], "Input type": ["c10::BFloat16"]}}) == 16
    assert math.isnan(event_bytes({"args": {"Input Dims": [[8]]}}))                        # no dtype named


def test_a_clock_rate_drift_is_fitted_and_a_moved_action_still_is_not():
    """torch's profiler clock may run a few hundred ppm off perf_counter over a step a busy core stretched: one
    offset then leaves the late actions out of torch's spans; an offset and a rate fit them. A moved action still
    cannot be fitted by any rate within MAX_RATE."""
    from labkit.tricks.pipeline_trace import MAX_RATE, best_rate
    ours = [(0.1 * i, 0.1 * i + 0.05) for i in range(5)]                          # five 50 ms actions over 0.45 s
    drift = 4e-4                                                                   # 400 ppm
    theirs = [(7.0 + (1 + drift) * a - 1e-5, 7.0 + (1 + drift) * b + 1e-5) for a, b in ours]   # 10 µs of margin
    args = ([s for s, _ in theirs], [e for _, e in theirs], [a for a, _ in ours], [b for _, b in ours])
    assert best_rate(*args, max_rate=0.0)[1] < -1e-4          # one offset: short by over 0.1 ms
    rate, room = best_rate(*args)
    assert abs(rate - drift) < 1e-4 and room > 0, (rate, room)
    moved = list(args[0]), list(args[1])
    moved[0][2] += 0.002; moved[1][2] += 0.002                 # torch's third span 2 ms later than labkit's action
    assert best_rate(*moved, *args[2:])[1] < -1e-3 and MAX_RATE <= 1e-3
