"""Write a copy of a lesson with its ✏️ cells empty:

    python -m labkit.exercises blank NOTEBOOK [--out PATH]
"""
from __future__ import annotations

import argparse

from .blanks import blank_copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.exercises", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    blank = sub.add_parser("blank", help="copy a notebook with the exercise cells emptied")
    blank.add_argument("notebook")
    blank.add_argument("--out", default=None, help="where to write it (default: <name>.blank.ipynb beside it)")
    args = parser.parse_args(argv)
    print(blank_copy(args.notebook, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
