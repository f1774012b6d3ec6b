"""`python -m labkit ...`: the same training loop from a terminal, alone or under torchrun.

    python -m labkit run config.json --run-dir out/job1       # launches the ranks itself (like a notebook):
                                                              # records in out/job1/rank<r>.jsonl
    torchrun --nproc-per-node 2 -m labkit run config.json --run-dir runs/job1
                                                              # one rank per torchrun process (many nodes too:
                                                              # scripts/slurm.sbatch, scripts/pytorchjob.yaml)
    torchrun --nproc-per-node 2 --max-restarts 3 -m labkit run config.json --run-dir runs/job1
                                                              # restarts resume from runs/job1/checkpoints/
    python -m labkit show runs/job1                           # summary table; the failure report if it failed
    python -m labkit compare runs/a runs/b -o ab.png          # the side-by-side figure, to a file

config.json holds RunConfig fields (RunConfig.save writes one); missing fields take their defaults. --run-dir is
the run directory itself, under both launchers; without it a plain run goes to a new directory under $LABKIT_RUNS
(or ./runs). Bad input (no such file, not JSON, a bad field, a damaged run directory) is one line on stderr naming
the file, and exit status 2; a run whose rank failed prints the failure report and exits 1.

    python -m labkit watch --timeout 30 -- torchrun --nproc-per-node 2 train.py
                                                              # YOUR script, unchanged: records per rank in a run
                                                              # directory, a hang reported (rank, collective, line)
                                                              # and the job ended; exit 0 ok, 1 failed, 3 hung
    python -m labkit --version                                # also `labkit --version`, the installed script

The arguments are parsed before anything imports torch (labkit/__init__.py waits for the command line), so --help
and --version answer at once; each command imports what it needs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__

if TYPE_CHECKING:
    from .records import Run

BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and do what it says; returns the exit status."""
    args = parser().parse_args(argv)
    from . import _import_the_rest
    _import_the_rest()  # what `import labkit` left for after parsing: torch, the CUDA tracker
    from .config import ConfigError
    from .records import BadRunFile
    from .run.failure import LaunchError
    from .rundir import RunDirInUse
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, BadRunFile, RunDirInUse, LaunchError) as exc:
        print(f"labkit {args.command}: {one_line(exc)}", file=sys.stderr)
        return BAD_INPUT


def one_line(exc: BaseException) -> str:
    """An error of several lines (a config with many bad fields) as one line: its lines joined by "; "."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines).replace(":; ", ": ")


def parser() -> argparse.ArgumentParser:
    # The docstring's first line without its markdown: a terminal shows backticks as they are.
    top = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n")[0].replace("`", ""))
    top.add_argument("--version", action="version", version=f"labkit {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with a RunConfig JSON file")
    run.add_argument("config", type=Path)
    run.add_argument("--run-dir", type=Path, help="the run directory (under torchrun: the same path on every rank)")
    run.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a rank is hung")
    for name, text in (("show", "a run's summary table, and its failure report if it failed"),
                       ("summary", "a run's headline figures as JSON")):
        sub.add_parser(name, help=text).add_argument("run_dir", type=Path)
    compare = sub.add_parser("compare", help="throughput | loss | LR of several runs, side by side, to an image")
    compare.add_argument("run_dirs", type=Path, nargs="+")
    compare.add_argument("-o", "--output", type=Path, required=True, help="image file to write (.png, .svg, .pdf)")
    compare.add_argument("--x", choices=("step", "samples"), default="step")
    compare.add_argument("--smooth", type=int, default=1, help="running mean of throughput over this many steps")
    add_watch(sub)
    return top


def add_watch(sub: argparse._SubParsersAction) -> None:
    """The `watch` command's arguments (watch_command runs it)."""
    watch = sub.add_parser("watch", help="run your own command (torchrun, a script) with every rank recorded and "
                           "a hang reported", description="Run your own command unchanged (torchrun, a script): every rank "
                           "recorded into a run directory, a hang reported (the odd rank, its collective, its line) and "
                           "the job ended, the first NaN and the straggler named. Exit status: 0 finished, 1 the job "
                           "failed, 3 hung, 4 a rank was killed from outside, 2 bad input, 127 no such command.",
                           usage="labkit watch [--timeout S] [--startup-timeout S] [--run-dir DIR] -- COMMAND...")
    watch.add_argument("--timeout", type=float, default=30.0,
                       help="seconds a rank may go without an optimizer step or a new collective (default 30)")
    watch.add_argument("--startup-timeout", type=float, default=60.0,
                       help="the same, before a rank's first optimizer step (imports, data, setup; default 60)")
    watch.add_argument("--run-dir", type=Path, help="the run directory (default: a new one under $LABKIT_RUNS)")
    watch.add_argument("job", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- torchrun ... train.py")


def watch_command(args: argparse.Namespace) -> int:
    """Exit status: 0 the job finished; 1 it failed on its own; 3 it hung (labkit ended it); 4 a rank was killed
    from outside; 2 bad input; 127 the command is not on PATH."""
    from .run.watch import CommandNotFound
    from .tricks.watched import watch
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    try:
        run = watch(job, timeout=args.timeout, startup_timeout=args.startup_timeout, run_dir=args.run_dir, echo=True)
    except CommandNotFound as exc:
        print(f"labkit watch: {exc}", file=sys.stderr)
        return 127
    from .tricks.watched import watch_report
    return {"finished": 0, "failed": 1, "hung": 3, "killed": 4}[watch_report(run).outcome]


def run_command(args: argparse.Namespace) -> int:
    from .config import RunConfig
    from .run import RankFailure, launch
    from .run.torchrun import run_under_torchrun, under_torchrun
    config = RunConfig.load(args.config)
    if under_torchrun():
        return run_under_torchrun(config, args.run_dir, args.timeout)
    try:
        result = launch(config, timeout=args.timeout, run_dir=args.run_dir)
    except RankFailure as failure:
        print(failure, file=sys.stderr)
        return 1
    print(json.dumps(result.summary(), indent=2))
    return 0


def runs_named(args: argparse.Namespace) -> list[Run] | None:
    """The runs a show / summary / compare names; None (after one line on stderr) if one is missing."""
    from .records import Run
    dirs = args.run_dirs if args.command == "compare" else [args.run_dir]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        print(f"labkit {args.command}: no run directory at {', '.join(missing)}", file=sys.stderr)
        return None
    return [Run(d) for d in dirs]


def show_command(args: argparse.Namespace) -> int:
    from .view.report import describe_run
    runs = runs_named(args)
    if runs is None:
        return BAD_INPUT
    print(describe_run(runs[0]) if args.command == "show" else json.dumps(runs[0].summary(), indent=2))
    return 0


def compare_command(args: argparse.Namespace) -> int:
    from .view.figures import compare_figure
    runs = runs_named(args)
    if runs is None:
        return BAD_INPUT
    args.output.parent.mkdir(parents=True, exist_ok=True)
    compare_figure(runs, x=args.x, smooth=args.smooth).savefig(args.output, dpi=100, bbox_inches="tight")
    print(f"wrote {args.output}")
    return 0


COMMANDS = {"watch": watch_command, "run": run_command, "show": show_command, "summary": show_command, "compare": compare_command}


if __name__ == "__main__":
    sys.exit(main())
