"""How much room each measured claim has: run the lessons several times, table every claim's worst margin.

    python tools/margins.py run --rounds 5 --busy 1 --out /tmp/margins          # the lessons, 5 quiet + 1 busy
    python tools/margins.py run --rounds 5 --lessons 03 11 --out /tmp/margins    # some lessons only
    python tools/margins.py table /tmp/margins --write tests/margins            # tests/margins.md and .json

`run` executes the lessons the way `make test` does (pytest --nbmake, LABKIT_QUICK=1, MPLBACKEND=Agg), each round
with its own claims log (quiet-<i>.jsonl), then `--busy` rounds more while a spin loop keeps one core busy
(busy-<i>.jsonl). A round whose lesson fails is kept: its failed claims count against their margin.

`table` reads every log in a folder. A claim's check records each number it held against a limit
(labkit.measure.below / above, kept in the log as `bounds`); its margin is how far the value sits from the limit,
as a fraction of the limit, and a claim's worst margin is the least over its bounds and the quiet rounds that
checked it. A claim that holds no number against a limit (an equality, a set of names) is listed with how often it
held. The busy rounds are shown apart: with a core kept busy most gated claims are not checked, by design, and what
is checked then must still hold. `--write PREFIX` writes PREFIX.md (the table) and PREFIX.json (per claim: worst
margin, values, limit), which `make test`'s summary reads to say, for a claim that failed, the worst margin the
table saw for it.

Goal (issue 41): every gated claim's worst margin over five quiet rounds at 20% or more; a claim that cannot have
it on this kind of machine is marked not checked there, with its reason.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.20
LESSON = re.compile(r"^(\d\d[a-z]?): ")


def lesson_paths(lessons: list[str] | None) -> list[Path]:
    every = sorted(p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb") if not p.name.endswith(".blank.ipynb"))
    if not lessons:
        return every
    chosen = [p for p in every if p.name[:2] in lessons]
    missing = sorted(set(lessons) - {p.name[:2] for p in chosen})
    if missing:
        raise SystemExit(f"no lesson numbered {missing}; there are {[p.name[:2] for p in every]}")
    return chosen


def run_round(paths: list[Path], log: Path, runs: Path) -> int:
    """One pass over the lessons as make test runs them, logging claims to `log`; pytest's exit status."""
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LABKIT_QUICK": "1", "LABKIT_RUNS": str(runs), "LABKIT_CLAIMS_LOG": str(log),
           "MPLBACKEND": "Agg"}
    command = [sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=300", "-q", "-p", "no:cacheprovider",
               *map(str, paths)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env)
    print(f"{log.name}: exit {done.returncode} in {time.monotonic() - started:.0f} s", flush=True)
    return done.returncode


def spin() -> subprocess.Popen:
    """A process that keeps one core busy until it is ended (the 'core kept busy' of the developers' guide)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run(args: argparse.Namespace) -> None:
    out, paths = Path(args.out), lesson_paths(args.lessons)
    out.mkdir(parents=True, exist_ok=True)
    first = len(list(out.glob("quiet-*.jsonl")))
    for i in range(first, first + args.rounds):
        run_round(paths, out / f"quiet-{i}.jsonl", out / "runs")
    first = len(list(out.glob("busy-*.jsonl")))
    for i in range(first, first + args.busy):
        busy = spin()
        try:
            run_round(paths, out / f"busy-{i}.jsonl", out / "runs")
        finally:
            busy.kill()
            busy.wait()


# --- the table ---------------------------------------------------------------------------------------------------

def read(path: Path) -> list[dict[str, Any]]:
    """A claims log's rows; a claim logged twice in one round (a cell run twice) keeps its last outcome."""
    latest: dict[str, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            latest[row["claim"]] = row
    return list(latest.values())


def gather(folder: Path) -> dict[str, dict[str, Any]]:
    """{claim: {"kind", "quiet": [outcome per quiet round], "busy": [...]}} from every log in `folder`."""
    claims: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        mode = "busy" if path.name.startswith("busy") else "quiet"
        for row in read(path):
            entry = claims.setdefault(row["claim"], {"kind": row.get("kind", "gated"), "quiet": [], "busy": []})
            entry[mode].append(row)
    return claims


def summarise(claim: str, entry: dict[str, Any]) -> dict[str, Any]:
    """One claim's line of the table: how its quiet rounds went, its bounds' values and worst margin."""
    quiet, busy = entry["quiet"], entry["busy"]
    count = lambda rows, status: sum(r["status"] == status for r in rows)  # noqa: E731
    bounds: dict[str, dict[str, Any]] = {}
    for row in quiet:
        if row["status"] == "skipped":
            continue
        for b in row.get("bounds", []):
            key = b.get("what") or "value"
            kept = bounds.setdefault(key, {"op": b["op"], "limits": [], "values": [], "margins": []})
            kept["values"].append(b["value"])
            kept["limits"].append(b["limit"])
            if b.get("margin") is not None:
                kept["margins"].append(b["margin"])
    margins = [m for b in bounds.values() for m in b["margins"]]
    # The same value in every round (a seeded computation, a count): a margin that cannot swing, so no flake.
    steady = bool(bounds) and sum(r["status"] != "skipped" for r in quiet) >= 2 and all(
        len({round(v, 12) for v in b["values"]}) == 1 for b in bounds.values())
    busy_bounds = [b for r in busy if r["status"] != "skipped" for b in r.get("bounds", [])]
    busy_margins = [b["margin"] for b in busy_bounds if b.get("margin") is not None]
    return {
        "claim": claim, "lesson": (LESSON.match(claim) or [None, "other"])[1], "kind": entry["kind"],
        "quiet": {s: count(quiet, s) for s in ("checked", "failed", "skipped")},
        "busy": {s: count(busy, s) for s in ("checked", "failed", "skipped")},
        "bounds": bounds,
        "worst_margin": min(margins) if margins else None,
        "steady": steady,
        "busy_worst_margin": min(busy_margins) if busy_margins else None,
        "skip_reasons": sorted({r.get("reason", "") for r in quiet if r["status"] == "skipped"})[:2],
    }


def table(folder: Path) -> list[dict[str, Any]]:
    """Every claim that was gated, or checked against a limit, in lesson order."""
    rows = [summarise(claim, entry) for claim, entry in gather(folder).items()]
    rows = [r for r in rows if r["kind"] == "gated" or r["bounds"]]
    return sorted(rows, key=lambda r: (r["lesson"], r["claim"]))


def _pct(margin: float | None) -> str:
    return "–" if margin is None else f"{margin:+.0%}"


def _bound_text(name: str, b: dict[str, Any]) -> str:
    limits = sorted(set(round(x, 6) for x in b["limits"]))
    limit = f"{limits[0]:.4g}" if len(limits) == 1 else f"{min(limits):.4g}..{max(limits):.4g}"
    values = ", ".join(f"{v:.3g}" for v in b["values"])
    return f"{name} {b['op']} {limit}: {values}"


def verdict(row: dict[str, Any]) -> str:
    q = row["quiet"]
    if q["failed"]:
        return "FAILED"
    if q["checked"] == 0:
        return "not checked"
    if row["worst_margin"] is None:
        return "held (no number)" if row["kind"] == "gated" else "held"
    if row["worst_margin"] >= GOAL:
        return "ok"
    return "same every round" if row["steady"] else "THIN"


def markdown(rows: list[dict[str, Any]], folder: Path) -> str:
    rounds = {m: len(list(folder.glob(f"{m}-*.jsonl"))) for m in ("quiet", "busy")}
    thin = [r for r in rows if verdict(r) in ("THIN", "FAILED")]
    lines = [
        "# Margins of the measured claims",
        "",
        f"_Made by `python tools/margins.py table {folder.name} --write tests/margins` from {rounds['quiet']} quiet "
        f"rounds and {rounds['busy']} with one core kept busy (`python tools/margins.py run --rounds "
        f"{rounds['quiet']} --busy {rounds['busy']} --out {folder.name}`), quick mode, as `make test` runs the "
        "lessons._",
        "",
        "Margin: how far a value sits from its limit, as a fraction of the limit (+25%: a quarter of the limit to "
        "spare). Worst: the least over the quiet rounds that checked the claim and over its numbers. Goal: 20% or "
        "more. `checked/failed/skipped` count rounds; busy rounds skip most gated claims by design. "
        "'same every round': a number that did not change between rounds (a seeded computation, a count), so its "
        "margin cannot swing; the goal is for numbers that vary.",
        "",
        f"{len(rows)} claims; {sum(verdict(r) == 'ok' for r in rows)} ok, {len(thin)} thin or failed, "
        f"{sum(verdict(r) == 'same every round' for r in rows)} under the goal but the same every round, "
        f"{sum(verdict(r).startswith('held') for r in rows)} hold no number, "
        f"{sum(verdict(r) == 'not checked' for r in rows)} not checked in a quiet round.",
        "",
        "| claim | kind | quiet c/f/s | busy c/f/s | numbers (quiet rounds) | worst | busy worst | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        numbers = "<br>".join(_bound_text(name, b) for name, b in r["bounds"].items()) or (
            "; ".join(r["skip_reasons"]) if not r["quiet"]["checked"] else "")
        q, b = r["quiet"], r["busy"]
        lines.append(f"| {r['claim'].replace('|', '/')} | {r['kind']} | {q['checked']}/{q['failed']}/{q['skipped']} "
                     f"| {b['checked']}/{b['failed']}/{b['skipped']} | {numbers.replace('|', '/')} "
                     f"| {_pct(r['worst_margin'])} | {_pct(r['busy_worst_margin'])} | {verdict(r)} |")
    return "\n".join(lines) + "\n"


def write(args: argparse.Namespace) -> None:
    folder = Path(args.folder)
    rows = table(folder)
    text = markdown(rows, folder)
    if args.write:
        prefix = Path(args.write)
        prefix.with_suffix(".md").write_text(text, encoding="utf-8")
        worst = {r["claim"]: {"worst_margin": r["worst_margin"], "verdict": verdict(r),
                              "bounds": {k: {"op": b["op"], "limit": b["limits"][-1] if b["limits"] else None,
                                             "values": b["values"]} for k, b in r["bounds"].items()}}
                 for r in rows}
        prefix.with_suffix(".json").write_text(json.dumps(worst, indent=1, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
        print(f"wrote {prefix.with_suffix('.md')} and {prefix.with_suffix('.json')}")
    else:
        print(text)
    thin = [r for r in rows if verdict(r) in ("THIN", "FAILED")]
    for r in thin:
        print(f"{verdict(r)}: {r['claim']} (worst margin {_pct(r['worst_margin'])})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the lessons several times, one claims log per round")
    r.add_argument("--rounds", type=int, default=5, help="quiet rounds (default 5)")
    r.add_argument("--busy", type=int, default=1, help="rounds with one core kept busy (default 1)")
    r.add_argument("--lessons", nargs="*", help="lesson numbers (default: every lesson)")
    r.add_argument("--out", required=True, help="folder for the logs (rounds already there are added to)")
    t = sub.add_parser("table", help="the margins table from a folder of claims logs")
    t.add_argument("folder")
    t.add_argument("--write", help="PREFIX: write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    if getattr(args, "rounds", 1) < 0 or getattr(args, "busy", 0) < 0:
        parser.error("--rounds and --busy must be 0 or more")
    if args.command == "table" and not any(Path(args.folder).glob("*-[0-9]*.jsonl")):
        parser.error(f"{args.folder}: no claims logs there (quiet-N.jsonl, busy-N.jsonl); make them with "
                     f"`python tools/margins.py run --out {args.folder}`")
    run(args) if args.command == "run" else write(args)


if __name__ == "__main__":
    main()
