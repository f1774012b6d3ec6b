import json

import pandas as pd
import pytest

from labkit.records import Run, per_step, write_meta


def test_global_throughput_is_all_samples_over_the_slowest_rank():
    df = pd.DataFrame([
        {"rank": 0, "step": 0, "loss": 2.0, "lr": 0.1, "samples": 8, "tokens": 80, "t_step": 0.1},
        {"rank": 1, "step": 0, "loss": 3.0, "lr": 0.1, "samples": 8, "tokens": 80, "t_step": 0.2},
    ])
    row = per_step(df).iloc[0]
    assert row["samples_per_s"] == pytest.approx(16 / 0.2)
    assert row["tokens_per_s"] == pytest.approx(160 / 0.2)
    assert (row["loss"], row["loss_min"], row["loss_max"]) == (2.5, 2.0, 3.0)


def test_a_line_cut_by_a_crash_is_skipped_and_summary_reads_the_rest(tmp_path):
    write_meta(tmp_path, name="x", world_size=1, launched_at=100.0)
    lines = [json.dumps({"rank": 0, "step": s, "time": 100.5 + s, "loss": 1.0 / (s + 1),
                         "lr": 0.1, "samples": 4, "tokens": 0, "t_step": 0.5}) for s in range(3)]
    (tmp_path / "rank0.jsonl").write_text("\n".join(lines) + '\n{"rank": 0, "step": 3, "lo')
    run = Run(tmp_path)
    assert len(run.df) == 3
    summary = run.summary()
    assert summary["steps"] == 3
    assert summary["time_to_first_step_s"] == pytest.approx(0.5)
    assert summary["median_samples_per_s"] == pytest.approx(8.0)
    assert summary["samples_per_s"] == pytest.approx(8.0)
    assert summary["final_loss"] == pytest.approx(1 / 3)


def test_whole_run_throughput_is_not_biased_by_jitter_between_ranks():
    from labkit.records import whole_run_throughput
    # Two ranks whose step boundaries jitter: steps 1..3 take 0.9 s on rank 0 and 1.0 s on rank 1 in total,
    # but the per-step maxima (0.3, 0.4, 0.4) make the median per-step rate 50/s, below the true 60/s.
    times = {0: [0.1, 0.3, 0.3, 0.3], 1: [0.1, 0.2, 0.4, 0.4]}
    df = pd.DataFrame([{"rank": r, "step": s, "samples": 10, "t_step": t, "loss": 1.0}
                       for r, ts in times.items() for s, t in enumerate(ts)])
    assert whole_run_throughput(df) == pytest.approx(60 / 1.0)   # steps 1..3: 60 samples, slowest rank 1.0 s
    assert per_step(df)["samples_per_s"].iloc[1:].median() < whole_run_throughput(df)


def test_missing_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run directory"):
        Run(tmp_path / "nope")


def test_tensorboard_events_are_made_from_the_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from labkit.records import RankRecorder, write_tensorboard
    for rank in range(2):
        recorder = RankRecorder(tmp_path, rank)
        for step in range(3):
            recorder.write({"step": step, "time": 1000.0 + step, "loss": rank + step / 10, "ok": True})
        recorder.close()
    write_tensorboard(tmp_path)
    write_tensorboard(tmp_path)  # rewriting replaces, it does not append a second copy
    events = EventAccumulator(str(tmp_path / "tb" / "rank1"))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]  # booleans and bookkeeping fields are not scalars
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss")] == [(0, 1.0), (1, 1.1), (2, 1.2)]


def test_slowest_takes_each_steps_largest_value_over_ranks():
    from labkit.records import slowest_per_step
    df = pd.DataFrame({"rank": [0, 1, 0, 1, 0, 1], "step": [0, 0, 1, 1, 2, 2],
                       "t_step": [0.1, 0.3, 0.2, 0.1, 0.5, 0.4], "t_data": [0.0, 0.05, 0.02, 0.01, 0.0, 0.0]})
    table = slowest_per_step(df, ["t_step", "t_data"], after=1)
    assert table.index.tolist() == [1, 2]
    assert table["t_step"].tolist() == [0.2, 0.5] and table["t_data"].tolist() == [0.02, 0.0]
    with pytest.raises(KeyError, match="t_optim"):
        slowest_per_step(df, ["t_optim"])


def test_lr_disagreement_names_the_first_step_where_the_ranks_lrs_differ(tmp_path):
    write_meta(tmp_path, name="x", world_size=2)
    lrs = {0: [0.1, 0.1, 0.05, 0.05, 0.025], 1: [0.1, 0.1, 0.1, 0.05, 0.025]}
    for rank, values in lrs.items():
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"rank": rank, "step": s, "lr": lr, "loss": 1.0}) + "\n" for s, lr in enumerate(values)))
    assert Run(tmp_path).lr_disagreement() == 2
    (tmp_path / "rank1.jsonl").write_text("".join(
        json.dumps({"rank": 1, "step": s, "lr": lr, "loss": 1.0}) + "\n" for s, lr in enumerate(lrs[0])))
    assert Run(tmp_path).lr_disagreement() is None


def test_a_restarted_runs_records_stand_by_the_latest_attempt_and_attempts_say_what_each_cost(tmp_path, monkeypatch):
    from labkit.records import RankRecorder
    write_meta(tmp_path, name="x", world_size=1, attempts=[{"attempt": 0, "failure": "rank 0 was killed"},
                                                           {"attempt": 1, "failure": None}])
    monkeypatch.setenv("LABKIT_ATTEMPT", "0")
    first = RankRecorder(tmp_path, 0)
    for step in range(5):
        first.write({"step": step, "time": 10.0 + step, "loss": 1.0})
    first._file.write('{"rank": 0, "attempt": 0, "step": 5, "lo')  # the kill cut the last line short
    first.close()
    monkeypatch.setenv("LABKIT_ATTEMPT", "1")
    second = RankRecorder(tmp_path, 0)  # resumed after the checkpoint of step 2
    for step in range(3, 6):
        second.write({"step": step, "time": 20.0 + step, "loss": 2.0})
    second.close()
    run = Run(tmp_path)
    assert run.df["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert run.df["attempt"].tolist() == [0, 0, 0, 1, 1, 1] and run.df["loss"].tolist() == [1.0] * 3 + [2.0] * 3
    assert len(run.read_records(superseded=True)) == 8
    attempts = run.attempts()
    assert attempts[["first_step", "last_step"]].values.tolist() == [[0, 4], [3, 5]]
    assert attempts.loc[1, "downtime_s"] == pytest.approx(23.0 - 14.0) and attempts.loc[1, "redone_steps"] == 2
    assert attempts.loc[0, "failure"] == "rank 0 was killed"


def test_summary_of_records_without_timings_says_nan_rather_than_failing(tmp_path):
    """A function's own records (a loss, no t_step or samples) still have a summary: the loss, and NaN speeds."""
    write_meta(tmp_path, name="own records", world_size=1)
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps({"rank": 0, "step": s, "loss": 2.0 - s}) + "\n"
                                                  for s in range(3)))
    summary = Run(tmp_path).summary()
    assert summary["steps"] == 3 and summary["final_loss"] == 0.0
    assert all(pd.isna(summary[k]) for k in ("samples_per_s", "median_samples_per_s", "median_tokens_per_s"))


def test_meta_is_replaced_whole_and_read_back(tmp_path):
    from labkit.records import read_meta
    assert read_meta(tmp_path) == {}
    write_meta(tmp_path, name="a", world_size=2)
    write_meta(tmp_path, **{**read_meta(tmp_path), "outcome": "finished"})
    assert read_meta(tmp_path)["outcome"] == "finished" and read_meta(tmp_path)["name"] == "a"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]   # no temporary file left beside it


def test_a_new_run_directory_draws_another_tag_when_its_name_is_taken(tmp_path, monkeypatch):
    """Two launches of one label in the same second may draw the same random tag (seen once in a mutation run of
    several hundred launches): the second draws again instead of failing with FileExistsError."""
    import labkit.rundir as rundir
    tags = iter(["abcd", "abcd", "beef"])
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda n: next(tags))
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20261207-080000")
    first, second = rundir.RunDir.new(tmp_path, "check"), rundir.RunDir.new(tmp_path, "check")
    assert first.path.name == "20261207-080000-check-abcd" and second.path.name == "20261207-080000-check-beef"
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda n: "abcd")
    with pytest.raises(rundir.RunDirInUse, match="8 new run directories"):
        rundir.RunDir.new(tmp_path, "check")
