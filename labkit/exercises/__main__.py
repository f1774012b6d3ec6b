"""A lesson's exercises, from a terminal:

    python -m labkit.exercises blank NOTEBOOK [--out PATH]        # a copy with the ✏️ cells empty, in blank mode
    python -m labkit.exercises solved NOTEBOOK --out PATH         # a copy with every folded solution put in its cell
    python -m labkit.exercises write-first NOTEBOOK [--out PATH]  # solved ✏️ cells to stubs, solutions folded
"""
from __future__ import annotations

import argparse

from .blanks import blank_copy, solved_copy, write_first


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
    args = parser.parse_args(argv)
    make = {"blank": blank_copy, "solved": solved_copy, "write-first": write_first}[args.command]
    try:
        print(make(args.notebook, args.out))
    except (OSError, ValueError) as error:
        parser.exit(2, f"{error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
