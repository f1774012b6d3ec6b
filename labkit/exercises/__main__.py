"""A lesson's exercises, from a terminal:

    python -m labkit.exercises blank NOTEBOOK [--out PATH]        # a copy with the ✏️ cells empty, in blank mode
    python -m labkit.exercises solved NOTEBOOK --out PATH         # a copy with every folded solution put in its cell
    python -m labkit.exercises write-first NOTEBOOK [--out PATH]  # solved ✏️ cells to stubs, solutions folded
    python -m labkit.exercises student OUTDIR [--lessons 16 24]    # the learners' edition: stubs, no solution
    python -m labkit.exercises solutions OUTDIR [--lessons ...]    # the instructor's: solutions in nbgrader regions
    python -m labkit.exercises grade SUBMISSION.ipynb ... [--csv grades.csv] [--cell-timeout 300]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .blanks import blank_copy, solved_copy, write_first
from .editions import lessons_dir, reads_the_clone, write_edition


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.exercises", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    blank = sub.add_parser("blank", help="copy a notebook with the exercise cells emptied")
    blank.add_argument("notebook")
    blank.add_argument("--out", default=None, help="where to write it (default: <name>.blank.ipynb beside it)")
    solved = sub.add_parser("solved", help="copy a notebook with each folded solution in its exercise cell")
    solved.add_argument("notebook")
    solved.add_argument("--out", required=True, help="where to write it")
    first = sub.add_parser("write-first", help="turn solved exercise cells into stubs, their solutions folded")
    first.add_argument("notebook")
    first.add_argument("--out", default=None, help="where to write it (default: the notebook itself)")
    for kind, what in (("student", "every lesson with stubs and no solution (nbgrader's metadata on)"),
                       ("solutions", "every lesson with its solutions in nbgrader's solution regions")):
        edition = sub.add_parser(kind, help=f"write {what}")
        edition.add_argument("outdir")
        edition.add_argument("--lessons", nargs="+", default=None, help="some lessons only, by number or name")
        edition.add_argument("--source", default=None, help="the lessons' folder (default: labkit's notebooks/)")
    grading = sub.add_parser("grade", help="run learners' notebooks in grade mode: learner x exercise, and a CSV")
    grading.add_argument("submissions", nargs="+")
    grading.add_argument("--csv", default=None, help="write every verdict there")
    grading.add_argument("--cell-timeout", type=float, default=300, help="seconds a cell may run (300)")
    grading.add_argument("--notebook-timeout", type=float, default=1800, help="seconds a submission may run")
    grading.add_argument("--full", action="store_true", help="full sizes (default: quick mode, LABKIT_QUICK=1)")
    args = parser.parse_args(argv)
    if args.command in ("student", "solutions"):
        try:
            written = write_edition(args.command, args.outdir, args.lessons, args.source)
        except (OSError, ValueError) as error:
            parser.exit(2, f"{error}\n")
        print(f"{len(written)} lessons, {args.command} edition, in {args.outdir}")
        clone = lessons_dir().parent.resolve()
        readers = [path.stem[:2] for path in written if reads_the_clone(path)]
        if readers and Path(args.outdir).resolve().parent != clone:
            print(f"note: lessons {', '.join(readers)} read the clone's files (../examples, pyproject.toml); "
                  f"they run where the edition is a folder of the clone, e.g. {clone / 'handout'}")
        return 0
    if args.command == "grade":
        return _grade(parser, args)
    make = {"blank": blank_copy, "solved": solved_copy, "write-first": write_first}[args.command]
    try:
        print(make(args.notebook, args.out))
    except (OSError, ValueError) as error:
        parser.exit(2, f"{error}\n")
    return 0


def _grade(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .grading import grade, table

    missing = [path for path in args.submissions if not Path(path).is_file()]
    if missing:
        parser.exit(2, f"no such notebook: {', '.join(missing)}\n")
    if args.cell_timeout <= 0 or args.notebook_timeout <= 0:
        parser.exit(2, "--cell-timeout and --notebook-timeout must be > 0 seconds\n")
    rows = grade(args.submissions, csv_path=args.csv, cell_timeout=args.cell_timeout,
                 notebook_timeout=args.notebook_timeout, quick=not args.full, echo=True)
    print(table(rows))
    if args.csv:
        print(f"(every verdict in {args.csv})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
