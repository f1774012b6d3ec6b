"""The glossary, English and 中文: notebooks/GLOSSARY.md, written from tools/glossary_data.json.

    python tools/glossary.py            # rewrites notebooks/GLOSSARY.md
    python tools/glossary.py --check    # exits 1 if notebooks/GLOSSARY.md is not what the data gives

Each term: the English term, its 中文, a one-line definition in English and in Chinese, and the lessons that show it.
`glossary_html()` gives the book the same table.
"""
from __future__ import annotations

import argparse
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE / "glossary_data.json"
OUT = HERE.parent / "notebooks" / "GLOSSARY.md"


def terms(path: Path = DATA) -> list[dict[str, Any]]:
    """The terms, in alphabetical order of their English."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))["terms"]
    return sorted(data, key=lambda t: re.sub(r"[^a-z0-9 ]", "", t["term"].lower()))


def lesson_files(notebooks: Path = OUT.parent) -> dict[str, str]:
    return {p.name[:2]: p.name for p in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")) if ".blank." not in p.name}


def markdown() -> str:
    files = lesson_files()
    out = ["# Glossary · 术语表", "",
           "The terms of the lessons' headers, in English and Chinese, each with the lessons that show it.",
           "各课标题单元格中的术语，中英对照，并注明讲解它的课。",
           "Generated from `tools/glossary_data.json` by `python tools/glossary.py`; edit the data, not this file.", "",
           "| English | 中文 | definition | 释义 | lesson |", "|---|---|---|---|---|"]
    for t in terms():
        lessons = ", ".join(f"[{n}]({files[n]})" if n in files else n for n in t["lessons"])
        out.append("| " + " | ".join(x.replace("|", "\\|") for x in (
            t["term"], t["zh"], t["definition"], t.get("zh_definition", ""), lessons)) + " |")
    return "\n".join(out) + "\n"


def glossary_html() -> str:
    """The glossary as an HTML section for the book."""
    rows = "\n".join(f"<tr><td>{html.escape(t['term'])}</td><td>{html.escape(t['zh'])}</td>"
                     f"<td>{html.escape(t['definition'])}</td><td>{html.escape(t.get('zh_definition', ''))}</td>"
                     f"<td>{', '.join(t['lessons'])}</td></tr>" for t in terms())
    return ('<section class="glossary"><style>.glossary table{border-collapse:collapse;font-size:.9em}'
            ".glossary td,.glossary th{border:1px solid #ddd;padding:.3em;vertical-align:top;text-align:left}</style>"
            '<h2>Glossary · 术语表</h2><table><tr><th>English</th><th>中文</th>'
            f"<th>definition</th><th>释义</th><th>lesson</th></tr>\n{rows}\n</table></section>")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that GLOSSARY.md is up to date")
    args = parser.parse_args(argv)
    text = markdown()
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print("GLOSSARY.md is up to date" if same else "GLOSSARY.md differs: run python tools/glossary.py")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"{OUT}: {len(terms())} terms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
