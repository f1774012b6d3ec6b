"""The folklore, judged: every trick of the three source articles beside the verdict a claims log gives it.

    python tools/folklore.py CLAIMS.jsonl --markdown OUT.md         # the table, from any run's claims log
    python tools/folklore.py CLAIMS.jsonl --snapshot README.md \\
        --run "a make test in quick mode"                           # README's dated block, and its log kept

tools/folklore_data.json lists the tricks (the articles' own titles, in Chinese), the claim each makes, the
lessons that test it, and which of the lessons' logged claims decide its verdict: `for` (their truth bears the
folklore out), `against` (their truth contradicts it) and `when` (the condition it holds under when both kinds are
checked). A reference matches every logged claim whose name starts with it ("14: adding TP to ZeRO-3 ..."), a '*'
standing for what the machine or the mode sets ("05: * workers cut t_data ...": as many workers as usable cores).

The verdict is computed from the log, never written by hand:
    holds               some claims for it checked, none against it
    holds only when ... claims for it and claims against it both checked: the row's condition
    does not hold here  claims against it checked, none for it
    not checked         none of its claims was decided here (skipped with a reason, absent from the log, or none)
A failed claim counts for the other side: a failed claim "against" is evidence for, and the other way round.

`make test` writes $(TEST_RUNS)/folklore.md; `folklore_html(log_path)` gives the book its section.
--snapshot writes the block between <!-- folklore:start --> and <!-- folklore:end --> in README.md, dated and naming
the machine, and keeps the log lines it used in tools/folklore_snapshot.jsonl, so that tests can rebuild the block.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE / "folklore_data.json"
SNAPSHOT = HERE / "folklore_snapshot.jsonl"
START, END = "<!-- folklore:start -->", "<!-- folklore:end -->"
VERDICTS = ("holds", "holds only when", "does not hold here", "not checked")
MARK = {"checked": "✓", "failed": "✗", "skipped": "–", "missing": "?"}
LEGEND = ("Measured here: the lesson claims that decide the row, ✓ checked, ✗ failed, – not checked, ? not in the log; "
          "'against' marks a claim whose truth contradicts the folklore; 'see' is shown and decides nothing.")


def load_data(path: Path = DATA) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_log(path: str | Path | None) -> dict[str, dict[str, Any]] | None:
    """{claim name: its latest logged outcome} (a cell run twice logs twice), or None where there is no log."""
    if path is None or not Path(path).exists():
        return None
    latest: dict[str, dict[str, Any]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if "claim" in row:
                latest[row["claim"]] = row
    return latest


def referenced(data: dict[str, Any]) -> list[str]:
    """Every claim reference of the data, in order, once."""
    refs: list[str] = []
    for trick in data["tricks"]:
        for row in trick["rows"]:
            for key in ("for", "against", "see"):
                refs += [r for r in row.get(key, []) if r not in refs]
    return refs


def matches(ref: str, name: str) -> bool:
    """Does the claim `name` start with `ref`? A '*' in ref stands for any text (a count of cores, of ranks)."""
    return re.match(".*".join(re.escape(part) for part in ref.split("*")), name) is not None


def resolve(ref: str, log: dict[str, dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """A reference's status in the log (checked, failed, skipped or missing) and the outcomes it matches."""
    found = [o for name, o in log.items() if matches(ref, name)]
    if not found:
        return "missing", []
    statuses = {o.get("status") for o in found}
    status = "failed" if "failed" in statuses else "skipped" if "skipped" in statuses else "checked"
    return status, found


def _measured(outcomes: list[dict[str, Any]]) -> str:
    # a gated claim's measurement ends with what other programs kept busy: the gate's, not the claim's
    values = [re.sub(r"\s*\(?others kept [\d.]+ cores busy\)?$", "", str(o.get("measured") or "")) for o in outcomes]
    text = "; ".join(v for v in values if v)
    return text if len(text) <= 90 else text[:87] + "..."


def judge(row: dict[str, Any], log: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """One row's verdict and evidence from the log: {'verdict', 'why', 'evidence': [(mark, ref, measured)]}."""
    if log is None:
        return {"verdict": "not checked", "why": "no claims log", "evidence": []}
    support, contra, undecided, evidence, reasons = [], [], [], [], []
    for side in ("for", "against"):
        for ref in row.get(side, []):
            status, found = resolve(ref, log)
            if status == "checked":
                (support if side == "for" else contra).append(ref)
            elif status == "failed":
                (contra if side == "for" else support).append(ref)
            else:
                undecided.append(ref)
                reasons += [o.get("reason", "") for o in found if o.get("reason")] or \
                    ([] if found else [f"'{ref}' is not in this log"])
            shown = _measured(found) if status in ("checked", "failed") else \
                ("not checked: " + (found[0].get("reason") or "") if found else "not in this log")
            evidence.append((MARK[status] + (" against" if side == "against" else ""), ref, shown.strip()))
    for ref in row.get("see", []):
        status, found = resolve(ref, log)
        evidence.append(("see", ref, _measured(found) if found else "not in this log"))
    if support and contra:
        verdict, why = "holds only when", row.get("when", "(in part: see the claims)")
    elif support:
        verdict, why = "holds", ""
    elif contra:
        verdict, why = "does not hold here", ""
    else:
        verdict = "not checked"
        why = row.get("note") or "; ".join(dict.fromkeys(reasons)) or "no claim tests it"
    if row.get("note") and verdict != "not checked":
        why = (why + "; " if why else "") + row["note"]
    if undecided and verdict != "not checked":
        why = (why + "; " if why else "") + f"{len(undecided)} of its claims not checked here"
    return {"verdict": verdict, "why": why, "evidence": evidence}


def table(log_path: str | Path | None, data: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The table's rows: article, 中文 title, English, claim, lessons, verdict (and its condition or reason),
    evidence (the deciding claims with what they measured)."""
    data = data or load_data()
    log = read_log(log_path)
    rows = []
    for trick in data["tricks"]:
        for row in trick["rows"]:
            rows.append({"article": trick["article"], "title": trick["title"], "english": trick["english"],
                         "claim": row["claim"], "lessons": row["lessons"], **judge(row, log)})
    return rows


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}


def _verdict_text(row: dict[str, Any]) -> str:
    if row["verdict"] == "holds only when":
        return f"holds only when {row['why']}"
    return row["verdict"] + (f" ({row['why']})" if row["why"] else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], data: dict[str, Any] | None = None) -> str:
    """The table as markdown: one table per article, under the article's title."""
    data = data or load_data()
    c = counts(rows)
    out = [f"Of the articles' {len(rows)} claims: " + ", ".join(f"{n} {v}" for v, n in c.items()) + ".", ""]
    for art, meta in data["articles"].items():
        out += [f"#### Article {art}: {meta['title']} ({meta['english']})", "",
                "| article | 中文 title | English | claim | lesson | verdict | measured here |",
                "|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["article"] == art):
            measured = "<br>".join(f"{m} {ref}: {shown}" if shown else f"{m} {ref}" for m, ref, shown in r["evidence"])
            out.append("| " + " | ".join(_cell(x) for x in (
                art, r["title"], r["english"], r["claim"], ", ".join(r["lessons"]), _verdict_text(r), measured)) + " |")
        out.append("")
    out.append(LEGEND)
    return "\n".join(out) + "\n"


def folklore_html(log_path: str | Path | None) -> str:
    """The book's section: the folklore table from the claims log at `log_path` (a missing log: all not checked)."""
    data = load_data()
    rows = table(log_path, data)
    c = counts(rows)
    source = "no claims log was found" if read_log(log_path) is None else f"from {html.escape(str(log_path))}"
    out = ['<section class="folklore"><style>.folklore table{border-collapse:collapse;font-size:.9em}'
           ".folklore td,.folklore th{border:1px solid #ddd;padding:.3em;vertical-align:top;text-align:left}"
           ".folklore .holds{background:#e6f4ea}.folklore .holds-only-when{background:#fff7e0}"
           ".folklore .does-not-hold-here{background:#fde8e8}.folklore .not-checked{background:#f0f0f0}</style>"
           "<h2>The folklore, judged</h2>",
           f"<p>Every trick of the three source articles, judged by the claims this build's lessons logged "
           f"({source}): " + ", ".join(f"{n} {html.escape(v)}" for v, n in c.items()) + ".</p>"]
    for art, meta in data["articles"].items():
        out.append(f"<h3>Article {art}: {html.escape(meta['title'])} <small>({html.escape(meta['english'])})</small></h3>")
        out.append('<table><tr><th>中文 title</th><th>English</th><th>claim</th><th>lesson</th><th>verdict</th>'
                   '<th>measured here</th></tr>')
        for r in (r for r in rows if r["article"] == art):
            measured = "<br>".join(html.escape(f"{m} {ref}: {shown}" if shown else f"{m} {ref}")
                                   for m, ref, shown in r["evidence"])
            cls = r["verdict"].replace(" ", "-")
            out.append(f"<tr><td>{html.escape(r['title'])}</td><td>{html.escape(r['english'])}</td>"
                       f"<td>{html.escape(r['claim'])}</td><td>{', '.join(r['lessons'])}</td>"
                       f'<td class="{cls}">{html.escape(_verdict_text(r))}</td><td><small>{measured}</small></td></tr>')
        out.append("</table>")
    out.append(f"<p><small>{html.escape(LEGEND)} Built by tools/folklore.py from tools/folklore_data.json.</small></p>"
               "</section>")
    return "\n".join(out)


def machine() -> str:
    """This machine in words: CPU model, usable cores, torch's version (read without importing torch)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version
        torch = version("torch")
    except Exception:
        torch = "not installed"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores, torch {torch}"


def snapshot_block(snapshot: Path = SNAPSHOT) -> str:
    """README's block, rebuilt from the kept snapshot (its first line says when, where and from which run)."""
    lines = Path(snapshot).read_text(encoding="utf-8").splitlines()
    meta = json.loads(lines[0])["snapshot"]
    with_log = Path(snapshot).with_suffix(".tmp.jsonl")
    try:
        with_log.write_text("\n".join(lines[1:]) + "\n", encoding="utf-8")
        rows = table(with_log)
    finally:
        with_log.unlink(missing_ok=True)
    return (f"{START}\n_Snapshot of {meta['date']}, measured on {meta['machine']}: {meta['run']}. "
            f"Generated by `python tools/folklore.py CLAIMS.jsonl --snapshot README.md`, not written by hand; "
            f"`make test` writes the same table for its own run to `$(TEST_RUNS)/folklore.md`._\n\n"
            f"{markdown(rows)}{END}")


def write_snapshot(log_path: Path, readme: Path, run: str, where: str | None = None,
                   snapshot: Path = SNAPSHOT) -> str:
    log = read_log(log_path)
    if log is None:
        raise SystemExit(f"no claims log at {log_path}")
    refs = referenced(load_data())
    kept = [o for name, o in log.items() if any(matches(r, name) for r in refs)]
    date = time.strftime("%Y-%m-%d", time.gmtime(max(o.get("time", 0) for o in log.values())))
    meta = {"date": date, "machine": where or machine(), "run": run, "claims_in_log": len(log)}
    snapshot.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in [{"snapshot": meta}, *kept]) + "\n",
                        encoding="utf-8")
    block = snapshot_block(snapshot)
    text = readme.read_text(encoding="utf-8")
    if START in text and END in text:
        text = text[:text.index(START)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(text, encoding="utf-8")
    return block


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path, help="a claims log (LABKIT_CLAIMS_LOG of a make test or make book run)")
    parser.add_argument("--markdown", type=Path, help="write the table here as markdown")
    parser.add_argument("--snapshot", type=Path, help="rewrite the folklore block of this README")
    parser.add_argument("--run", default="a `make test` run in quick mode", help="which run the log came from")
    parser.add_argument("--machine", help="the machine the log was measured on (default: this one)")
    args = parser.parse_args(argv)
    if read_log(args.log) is None:
        print(f"folklore: no claims log at {args.log}: every row reads 'not checked'", file=sys.stderr)
    rows = table(args.log)
    if args.markdown:
        log = read_log(args.log) or {}
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(max((o.get("time", 0) for o in log.values()), default=0)))
        source = (f"From {args.log}: {len(log)} claims, the last logged {when}, on {args.machine or machine()}."
                  if log else f"No claims log at {args.log}.")
        args.markdown.write_text(f"## The folklore, judged\n\n{source}\n\n" + markdown(rows), encoding="utf-8")
    if args.snapshot:
        write_snapshot(args.log, args.snapshot, args.run, args.machine)
    print("folklore: " + ", ".join(f"{n} {v}" for v, n in counts(rows).items())
          + (f" -> {args.markdown}" if args.markdown else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
