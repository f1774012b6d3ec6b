"""labkit's command line: run, show, summary and compare, in this process where a real one adds nothing, and a real
process for the entry point and a bad file's one line."""
import os
import subprocess
import sys

from labkit import RunConfig, load_run


# torchrun running `labkit run` on every rank and recording each: test_resume's restarts under torchrun elastic (the
# records equal a notebook launch's) and test_nodes' Slurm and PyTorchJob runs, which start the same command.


def test_show_and_compare_read_run_directories(tmp_path, capsys):
    import pytest

    import labkit
    from labkit import Fault, RankFailure
    ok = labkit.launch(RunConfig(world_size=2, steps=3, tensorboard=False), runs_root=tmp_path, echo=False)
    with pytest.raises(RankFailure):
        labkit.launch(RunConfig(world_size=2, steps=5, tensorboard=False, faults=(Fault(kind="raise", rank=1, step=2),)),
                      runs_root=tmp_path, echo=False)
    failed = next(p for p in tmp_path.iterdir() if p != ok.path)
    shown = _main(capsys, "show", ok.path)
    assert shown.code == 0 and "finished: every rank ended cleanly" in shown.out and "final_loss" in shown.out
    shown = _main(capsys, "show", failed)
    assert "rank 1 raised at step 2" in shown.out and "InjectedFault" in shown.out, shown.out
    figure = tmp_path / "ab.png"
    summary = _main(capsys, "summary", ok.path)
    assert summary.code == 0 and '"steps": 3' in summary.out, summary.out
    drawn = _main(capsys, "compare", ok.path, failed, "-o", figure, "--smooth", "2")
    assert drawn.code == 0 and figure.read_bytes()[:4] == b"\x89PNG", drawn.err
    missing = _main(capsys, "show", tmp_path / "nope")
    assert missing.code == 2 and "no run directory" in missing.err


class Done:
    """What a command did: its exit status and what it printed (the shape of subprocess.run's answer)."""

    def __init__(self, code, out, err):
        self.code = self.returncode = code
        self.out = self.stdout = out
        self.err = self.stderr = err


def _main(capsys, *args):
    """The CLI in this process (labkit.cli.main, what `python -m labkit` calls): each real process pays seconds of
    imports, so only a few tests start one (the entry point, a bad file's one line)."""
    from labkit.cli import main
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return Done(code, out, err)


def _cli(*args, cwd=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "labkit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _one_line_no_traceback(done, *names):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(str(n) in lines[0] for n in names), lines[0]
    return lines[0]


def test_plain_run_writes_into_the_run_dir_given_and_show_reads_it(tmp_path, capsys):
    """--run-dir is the run directory itself without torchrun too (it used to be taken as the runs root)."""
    config = tmp_path / "config.json"
    RunConfig(world_size=1, global_batch=8, steps=2, tensorboard=False, save_final=False).save(config)
    job = tmp_path / "out" / "job1"
    done = _cli("run", config, "--run-dir", job)   # the real entry point, in a process of its own
    assert done.returncode == 0, done.stderr[-3000:]
    assert (job / "rank0.jsonl").exists() and '"steps": 2' in done.stdout
    shown = _main(capsys, "show", job)
    assert shown.code == 0 and "finished: every rank ended cleanly" in shown.out, shown.err
    again = _main(capsys, "run", config, "--run-dir", job)  # records would be appended to the first run's
    line = _one_line_no_traceback(again, job, "already holds the records")
    assert len(load_run(job).df) == 2, line


def test_bad_config_files_are_one_line_naming_the_file(tmp_path, capsys):
    missing = _one_line_no_traceback(_cli("run", tmp_path / "missing.json"), "missing.json")  # a real process
    assert "no such file" in missing
    bad = tmp_path / "bad.json"
    bad.write_text('{"world_size": 0}')
    assert "world_size" in _one_line_no_traceback(_main(capsys, "run", bad), "bad.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"world_size": 2,')
    assert "not valid JSON" in _one_line_no_traceback(_main(capsys, "run", broken), "broken.json")
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"wrold_size": 2}')
    assert "wrold_size" in _one_line_no_traceback(_main(capsys, "run", unknown), "unknown.json")


def test_a_damaged_meta_json_is_one_line_naming_it(tmp_path, capsys):
    import pytest

    from labkit.records import BadRunFile
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.jsonl").write_text('{"rank": 0, "step": 0, "loss": 1.0}\n')
    (run / "meta.json").write_text('{"world_size": 1, "outcome": "fini')  # a disk that filled up mid-write
    for command in ("show", "summary"):
        assert "not valid JSON" in _one_line_no_traceback(_main(capsys, command, run), run / "meta.json")
    with pytest.raises(BadRunFile, match="meta.json: not valid JSON"):
        load_run(run)
