"""torch.profiler's trace of one DDP step (lesson 16, issue 31): written per rank as Chrome trace JSON, read back, and
matched to labkit's probe, on real gloo ranks; the matcher fails on a trace with one all-reduce dropped or two
swapped, so the lesson's claim can fail."""
import dataclasses
import json

import pytest

from labkit.exercises import OverlapDDP, match_trace, read_trace, trace_step, trace_timeline
from labkit.exercises.traced import SPANS


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    return trace_step(OverlapDDP, warm=1, runs_root=tmp_path_factory.mktemp("runs"))


def test_each_rank_writes_chrome_trace_json_beside_the_run(traced):
    for rank in (0, 1):
        path = traced.path(rank)
        assert path.parent == traced.run.path and path.name == f"trace{rank}.json"
        events = json.loads(path.read_text())["traceEvents"]
        complete = [e for e in events if e.get("ph") == "X"]
        assert complete and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in complete)
        assert {SPANS["backward"], "c10d::allreduce_", "gloo:all_reduce"} <= {e["name"] for e in complete}


def test_the_trace_holds_the_probes_all_reduces_in_order(traced):
    for rank in (0, 1):
        trace, probe = read_trace(traced.path(rank)), traced.probe(rank)
        holds, measured = match_trace(trace, probe)
        assert holds, measured
        assert len(trace.allreduces) == len(probe) > 10 and trace.allreduces.bytes.notna().all()
        # overlap: every launch inside backward, on both clocks
        assert f"launched during backward: trace {len(probe)}, probe {len(probe)}" in measured
        assert (trace.allreduces.run_end_ms >= trace.allreduces.run_start_ms).all() and trace.backward_ms > 0


def test_the_matcher_fails_on_a_dropped_or_swapped_all_reduce(traced):
    trace, probe = read_trace(traced.path(0)), traced.probe(0)
    rows = trace.allreduces
    dropped = dataclasses.replace(trace, allreduces=rows.drop(index=rows.index[len(rows) // 2]).reset_index(drop=True))
    holds, measured = match_trace(dropped, probe)
    assert not holds and f"holds {len(rows) - 1} all-reduces, the probe saw {len(rows)}" in measured
    i = next(i for i in range(len(rows) - 1) if rows.bytes[i] != rows.bytes[i + 1])   # two of different sizes
    order = list(range(len(rows)))
    order[i], order[i + 1] = order[i + 1], order[i]
    swapped = dataclasses.replace(trace, allreduces=rows.iloc[order].reset_index(drop=True))
    holds, measured = match_trace(swapped, probe)
    assert not holds and f"the first, #{i}:" in measured
    # one launch moved after backward's end: the counts inside backward differ
    late = rows.copy()
    late.loc[0, "launch_ms"] = trace.backward_ms + 1.0
    holds, measured = match_trace(dataclasses.replace(trace, allreduces=late), probe)
    assert not holds and f"trace {len(rows) - 1}, probe {len(rows)}" in measured


def test_the_timeline_is_drawn_from_the_trace(traced):
    trace = read_trace(traced.path(0))
    fig = trace_timeline(trace, probe=traced.probe(0))
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "training thread" and labels[-1] == "labkit's probe"
    workers = trace.allreduces.thread.nunique()
    assert len(labels) == 2 + workers
    bars = [p for p in ax.patches if p.get_y() > 0.5 and p.get_y() < workers + 0.5]   # the gloo workers' rows
    assert len(bars) == len(trace.allreduces)


def test_a_file_that_is_no_trace_of_a_step_is_refused(tmp_path):
    path = tmp_path / "trace0.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}))
    with pytest.raises(ValueError, match="no 'labkit: backward' span"):
        read_trace(path)
