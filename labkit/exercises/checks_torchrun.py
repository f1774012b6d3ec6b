"""Your first script under torchrun, checked: it joins the job from the environment torchrun sets, all-reduces one
number, prints one line per rank, and leaves the job cleanly.

    path = script_path("first_job.py")             # where a lesson's %%writefile puts the learner's script
    report = check_script(path)                     # torchrun --standalone --nproc-per-node 2 path, under labkit.watch
    path = report.use(FIRST_JOB)                    # yours if it passed; labkit's script until then
    report.measured["lines"]                        # {rank: the line it printed}; report.measured["output"]: all of it

The script's contract: every rank all-reduces (sums) a tensor holding its rank + 1 and prints exactly one line

    rank {rank}/{world} local_rank {local_rank} device {device} sum {total}

and calls destroy_process_group() before it exits. torchrun is run as `python -m torch.distributed.run` beside this
Python (the same as the `torchrun` command, which a notebook's kernel may not have on its PATH), under labkit.watch:
a rank that hangs is stopped after `timeout` seconds without progress and its line in the script named.

    written   the script exists and parses (a stub's NotImplementedError is "not written yet")
    runs      the job finished (a crash names the rank and the script's line; a hang, where each rank waits)
    ranks     the ranks printed 0..n-1 once each and the world size n: read from RANK and WORLD_SIZE
    local     local_rank is LOCAL_RANK (on one node, the rank) and the device follows it (cuda:LOCAL_RANK or cpu)
    sum       every rank printed 1 + 2 + ... + n: the all-reduce reached every rank
    cleanup   destroy_process_group() is called (without it gloo's threads can abort a rank as Python exits)
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import torch

from ..rundir import RunDir, runs_root
from ..run.watch import Job, supervise
from .learner import report_failure
from .report import Report

FIRST_JOB = Path(__file__).with_name("first_job.py")   # the reference script
LINE = re.compile(r"^\[\w*?(\d+)\]:rank (-?\d+)/(-?\d+) local_rank (-?\d+) device (\S+) sum (\S+)\s*$", re.M)
HANG_HINT = ("Each process must join with the rank and world size torchrun gave it (init_method='env://' reads "
             "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT): a rank number written into the script makes two "
             "processes claim it, and the job waits for one that never joins.")
CONTRACT = "rank {rank}/{world} local_rank {local_rank} device {device} sum {total}"


def script_path(name: str) -> Path:
    """A path for a script the learner writes, in a folder of the runs root (made if missing)."""
    folder = runs_root() / "scripts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def torchrun_command(path: str | Path, nproc: int = 2) -> list[str]:
    """The torchrun line the checker runs, through this Python:  [python, -m, torch.distributed.run, ...]."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--tee", "3", str(path)]


def _unwritten(node: ast.AST) -> bool:
    """A `raise NotImplementedError("... not written yet")`, as blanks.py writes a stub's body, or nbgrader's
    `raise NotImplementedError()` (its student copy's stub)."""
    exc = node.exc if isinstance(node, ast.Raise) else None
    if isinstance(exc, ast.Call) and getattr(exc.func, "id", "") == "NotImplementedError":
        return not exc.args or "not written yet" in ast.unparse(exc)
    return getattr(exc, "id", "") == "NotImplementedError"


def _calls(tree: ast.AST) -> set[str]:
    return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


def check_script(path: str | Path, *, nproc: int = 2, timeout: float = 10.0) -> Report:
    """Run the script at `path` under torchrun on `nproc` local ranks and report:  check_script(path).ok."""
    path = Path(path)
    report = Report(f"{path.name}: a script under torchrun --nproc-per-node {nproc}", implementation=path)
    if not path.is_file():
        report.add("written", "missing", f"{path} does not exist yet: run the ✏️ cell (%%writefile) first")
        return report
    try:
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError as exc:
        report.add("written", "fail", f"{path.name} does not parse: {exc.msg} at line {exc.lineno}", part=path.name)
        return report
    if any(_unwritten(node) for node in ast.walk(tree)):   # the stub: no job to start
        report.add("written", "missing", "main is not written yet (it raises NotImplementedError). Write it in the ✏️ "
                                         "cell, run that cell, and run the check again.")
        return report
    target = RunDir.new(runs_root(), f"check-{path.stem}")
    with open(target.job_output, "wb") as out:
        job = supervise(torchrun_command(path, nproc), target, timeout, startup_timeout=timeout, output=out)
    output = target.job_output.read_text(errors="replace")
    report.run_dir, report.measured["output"] = target.path, output
    if re.search(r"^NotImplementedError(: .*not written yet.*)?$", output, re.M):
        report.add("written", "missing", "main is not written yet (the script raised NotImplementedError). Write it "
                                         "in the ✏️ cell, run that cell, and run the check again.")
        return report
    if not _finished(report, job, output, path.name):
        return report
    lines = {int(m[0]): m[1:] for m in LINE.findall(output)}
    report.measured["lines"] = {r: f"rank {a}/{b} local_rank {c} device {d} sum {e}" for r, (a, b, c, d, e)
                                in sorted(lines.items())}
    if _judge(report, lines, nproc, path.name):
        _cleanup(report, tree, path.name)
    return report


def _finished(report: Report, job: Job, output: str, part: str) -> bool:
    if job.outcome == "finished":
        report.add("runs", "pass", "the job finished: every rank exited 0")
        return True
    if "has not been initialized" in output:
        report.add("runs", "fail", "a collective ran before init_process_group(): join the job first "
                                   "(dist.init_process_group(backend, init_method='env://'))", part=part)
    elif job.failure is not None:
        report_failure(report, job.failure, hang_hint=HANG_HINT)
    else:
        report.add("runs", "fail", f"the job {job.outcome} (exit status {job.code}) before any rank started: read "
                                   "report.measured['output']", part=part)
    return False


def _judge(report: Report, lines: dict[int, tuple], nproc: int, part: str) -> bool:
    if len(lines) < nproc:
        silent = [r for r in range(nproc) if r not in lines]
        report.add("ranks", "fail", f"local rank(s) {silent} printed no line '{CONTRACT}' (print exactly that "
                                    "line, once, on every rank)", part=part)
        return False
    said = sorted(int(v[0]) for v in lines.values())
    worlds = {int(v[1]) for v in lines.values()}
    if said != list(range(nproc)):
        report.add("ranks", "fail", f"the {nproc} processes said ranks {said}, not {list(range(nproc))}: read the "
                                    "rank from os.environ['RANK'] (or dist.get_rank() after joining), never a "
                                    "number of your own", part=part)
        return False
    if worlds != {nproc}:
        report.add("ranks", "fail", f"the ranks said world size {sorted(worlds)}, torchrun started {nproc}: read "
                                    "WORLD_SIZE from the environment (or dist.get_world_size())", part=part)
        return False
    report.add("ranks", "pass", f"ranks 0..{nproc - 1} once each, world size {nproc}, from the environment")
    cuda = torch.cuda.is_available()
    for local, (rank, _, local_rank, device, _) in sorted(lines.items()):
        want = f"cuda:{local}" if cuda else "cpu"
        if int(local_rank) != local:
            report.add("local", "fail", f"local rank {local} printed local_rank {local_rank}: read LOCAL_RANK, the "
                                        "process's index on its own node (RANK counts every node)", part=part)
            return False
        if device != want:
            report.add("local", "fail", f"local rank {local} used device {device}, want {want}: "
                                        + ("torch.device('cuda', LOCAL_RANK), so that each process has its own GPU"
                                           if cuda else "no GPU here, so torch.device('cpu') and the gloo backend"),
                       part=part)
            return False
    report.add("local", "pass", f"local_rank is LOCAL_RANK, and the device follows it ({'cuda' if cuda else 'cpu'})")
    want_sum = nproc * (nproc + 1) / 2
    for local, (rank, *_, total) in sorted(lines.items()):
        if float(total) == int(rank) + 1 and nproc > 1:
            report.add("sum", "fail", f"rank {rank} printed sum {total}, its own value: the all-reduce did not run, "
                                      "or ran on another tensor than the one printed", part=part)
            return False
        if float(total) != want_sum:
            report.add("sum", "fail", f"rank {rank} printed sum {total}, want 1 + ... + {nproc} = {want_sum:g}: "
                                      "all-reduce (SUM) a tensor holding rank + 1", part=part)
            return False
    report.add("sum", "pass", f"every rank printed sum {want_sum:g}: the all-reduce reached all {nproc}")
    return True


def _cleanup(report: Report, tree: ast.AST, part: str) -> None:
    if "destroy_process_group" not in _calls(tree):
        report.add("cleanup", "fail", "destroy_process_group() is never called: leave the job before the script "
                                      "ends (without it, gloo's threads can abort a rank as Python exits, and "
                                      "torchrun then reports a failure after all the work was done)", part=part)
        return
    report.add("cleanup", "pass", "destroy_process_group() is called before the script ends")
