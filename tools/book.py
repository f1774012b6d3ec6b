"""The book's front page: site/index.html, the course map and its tracks, then the lessons in order, each with its
one-line summary and headline figure.

    python tools/book.py site/executed site      # executed notebooks in, index.html and figures/ out
    python tools/book.py site/executed site --times site/times.tsv --wall-s 1130   # and each lesson's seconds

`make book` executes every notebook into site/executed/, converts each to site/<name>.html, then runs this.
For each lesson: its title (the first heading), its summary (the notebook's row in README.md's table, else the
first sentence under the title), and its headline figure: the first image of a cell tagged "headline", else of
the first cell that calls compare(...), else the notebook's first image, else the last image a widget showed
(the playground's panel). A lesson without any image gets no figure, not an error.

With --tracks (default notebooks/tracks.json, when it exists) the page opens with the course map: the figure
(--map, default notebooks/course_map.png, drawn by tools/coursemap.py) and each track as a numbered list, each
lesson with its time and prerequisites read from its header; each lesson's block then says the same, and the
seconds it took in this build.

Each lesson's seconds come from the executed notebook itself (nbclient stamps every cell: from the first cell's
start to the last cell's reply); they are printed, with their sum, the book's wall time (--wall-s, measured by
`make book`) and its budget (BUDGET_S), and written to --times as a table.
"""
from __future__ import annotations

import argparse
import base64
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

STYLE = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:.2em} .lesson{border-top:1px solid #ddd;padding:1.2em 0}
.lesson h2{margin:.1em 0 .3em;font-size:1.25em} .lesson p{margin:.2em 0 .8em;line-height:1.45}
.lesson img{max-width:100%;border:1px solid #eee} a{color:#1f5fa8;text-decoration:none} code{font-size:.92em}
.map img{max-width:100%} .track li{margin:.15em 0} .meta,.track .meta{color:#666;font-size:.9em}"""


def lesson(notebook: Path, readme_rows: dict[str, str]) -> dict[str, Any]:
    """Title, summary and headline PNG (bytes or None) of one executed notebook."""
    nb = json.loads(notebook.read_text())
    cells = nb.get("cells", [])
    first = next((_text(c) for c in cells if c.get("cell_type") == "markdown"), "")
    heading = re.search(r"^#\s+(.+)$", first, re.M)
    title = heading.group(1).strip() if heading else notebook.stem
    summary = readme_rows.get(notebook.name) or _first_sentence(first[heading.end():] if heading else first)
    return {"name": notebook.stem, "title": title, "summary": summary, "figure": headline(nb)}


def headline(nb: dict[str, Any]) -> bytes | None:
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    tagged = [c for c in code if "headline" in c.get("metadata", {}).get("tags", [])]
    comparing = [c for c in code if re.search(r"\bcompare\(", _text(c))]
    for group in (tagged, comparing, code):
        for cell in group:
            png = _first_png(cell)
            if png is not None:
                return png
    return _widget_png(nb)


def readme_table(readme: Path) -> dict[str, str]:
    """{notebook file name: its 'what it shows' text} from README.md's notebook table."""
    rows = {}
    if readme.exists():
        for match in re.finditer(r"^\|\s*`([^`]+\.ipynb)`\s*\|\s*(.+?)\s*\|\s*$", readme.read_text(), re.M):
            rows[match.group(1)] = match.group(2)
    return rows


BUDGET_S = 25 * 60  # the whole book, executed at full size on 2 cores


def lesson_seconds(notebook: Path) -> float | None:
    """Seconds from the first cell's start to the last cell's reply, as nbclient stamped them (None: no stamps)."""
    from datetime import datetime
    stamps = [c.get("metadata", {}).get("execution", {}) for c in json.loads(notebook.read_text()).get("cells", [])]
    starts = [s["iopub.execute_input"] for s in stamps if "iopub.execute_input" in s]
    ends = [s["shell.execute_reply"] for s in stamps if "shell.execute_reply" in s]
    if not starts or not ends:
        return None
    when = [datetime.fromisoformat(t.replace("Z", "+00:00")) for t in (min(starts), max(ends))]
    return (when[1] - when[0]).total_seconds()


def times_table(executed: Path, wall_s: float | None = None) -> str:
    """Each executed lesson's seconds, their sum, the book's wall time and its budget, as tab-separated lines."""
    rows = [(p.stem, lesson_seconds(p)) for p in sorted(Path(executed).glob("[0-9]*.ipynb"))
            if not p.name.endswith(".blank.ipynb")]
    total = sum(s for _, s in rows if s is not None)
    lines = ["lesson\tseconds"] + [f"{name}\t{'' if s is None else format(s, '.0f')}" for name, s in rows]
    lines.append(f"sum of the lessons\t{total:.0f}")
    if wall_s is not None:
        lines.append(f"make book, wall time (kernels started, HTML, index)\t{wall_s:.0f}")
    lines.append(f"budget\t{BUDGET_S}")
    return "\n".join(lines) + "\n"


def build(executed: Path, site: Path, readme: Path = Path("README.md"), tracks: Path | None = None,
          course_map: Path | None = None, claims: Path | None = None) -> Path:
    """Write site/index.html (and site/figures/<name>.png) from the executed notebooks in `executed`; with `tracks`
    (notebooks/tracks.json), the course map and its tracks first (`course_map`: the map's PNG, copied); with
    `claims` (the claims log the lessons wrote while being executed), the source articles' folklore judged by it
    (tools/folklore.py) after the map, and the glossary (tools/glossary.py) after the lessons."""
    rows = readme_table(readme)
    notebooks = sorted(p for p in Path(executed).glob("*.ipynb") if not p.name.endswith(".blank.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no executed notebooks in {executed}: run `make book` (it executes them first)")
    figures = Path(site) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    course = _course(executed, tracks)
    parts = []
    for notebook in notebooks:
        info = lesson(notebook, rows)
        image = ""
        if info["figure"] is not None:
            (figures / f"{info['name']}.png").write_bytes(info["figure"])
            image = (f'<a href="{info["name"]}.html"><img src="figures/{info["name"]}.png" '
                     f'alt="{_inline(info["title"])}"></a>')
        meta = _meta(course, notebook) if course else ""
        anchor = f' id="lesson-{notebook.name[:2]}"' if course else ""
        parts.append(f'<div class="lesson"{anchor}><h2><a href="{info["name"]}.html">{_inline(info["title"])}</a></h2>'
                     f'{meta}<p>{_inline(info["summary"])}</p>{image}</div>')
    intro = ("Distributed PyTorch training, debugged and sped up by running it: every lesson below was executed "
             "to make this page. Start at the top; each title opens the lesson with all its output.")
    top = ""
    if course:
        intro = ("Distributed PyTorch training, debugged and sped up by running it: every lesson below was executed "
                 "to make this page. Pick a track, or start at the first lesson; each title opens the lesson with "
                 "all its output.")
        top = _map_section(course, figures, course_map)
    folklore = _tool("folklore").folklore_html(claims) if claims is not None else ""
    glossary = _tool("glossary").glossary_html() if claims is not None or course else ""
    # after the map and the folklore table, right above the lessons it heads (the map links to it: #lessons)
    lessons_heading = '<h2 id="lessons">Every lesson</h2>' if course else ""
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>labkit: the lessons</title>"
            f"<style>{STYLE}</style></head><body><h1>labkit: the lessons</h1>"
            f"<p>{intro}</p>" + top + folklore + lessons_heading + "\n".join(parts) + glossary + "</body></html>\n")
    index = Path(site) / "index.html"
    index.write_text(page)
    return index


def _coursemap():
    """tools/coursemap.py, loaded beside this file (tools/ is no package)."""
    return _tool("coursemap")


def _tool(name: str):
    """tools/<name>.py, loaded beside this file (tools/ is no package), once."""
    import importlib.util
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module          # dataclasses look the module up while it loads
        spec.loader.exec_module(module)
    return sys.modules[name]


def _course(executed: Path, tracks: Path | None) -> dict[str, Any] | None:
    """The lessons' headers (read from the executed notebooks: the same first cells) and the tracks, or None."""
    if tracks is None or not Path(tracks).exists():
        return None
    cm = _coursemap()
    lessons = cm.read_lessons(Path(executed))
    by = {l.number: l for l in lessons}
    known_tracks = [t for t in cm.load_tracks(Path(tracks)) if all(n in by for n in t["lessons"])]
    return {"cm": cm, "lessons": lessons, "by": by, "tracks": known_tracks}


def _needs(course: dict[str, Any], numbers: tuple[str, ...] | list[str]) -> str:
    if not numbers:
        return "needs nothing"
    links = [f'<a href="#lesson-{n}">{n}</a>' if n in course["by"] else n for n in numbers]
    return "needs " + ", ".join(links)


def _map_section(course: dict[str, Any], figures: Path, course_map: Path | None) -> str:
    """The map's figure, and each track as a numbered list: lesson, its time, its prerequisites."""
    cm, by = course["cm"], course["by"]
    out = ['<div class="map"><h2 id="map">The map: where to start</h2>']
    if course_map is not None and Path(course_map).exists():
        (figures / "course_map.png").write_bytes(Path(course_map).read_bytes())
        out.append('<p><a href="figures/course_map.png"><img src="figures/course_map.png" alt="The lessons as a graph '
                   'of prerequisites, coloured by track"></a></p><p class="meta">An arrow goes from a lesson to one '
                   'whose header names it under "You need". Open the figure for its full size.</p>')
    for track in course["tracks"]:
        quick, full = cm.total(track["lessons"], course["lessons"])
        out.append(f'<div class="track" id="track-{html.escape(track["id"])}"><h3>{_inline(track["name"])}</h3>'
                   f'<p>If {_inline(track["goal"])}: {len(track["lessons"])} lessons, run time about {cm.duration(quick)} '
                   f'in quick mode, {cm.duration(full)} at full size.</p>')
        if track.get("assumes"):
            named = ", ".join(f'<a href="#lesson-{n}">{n}</a> ({_inline(by[n].short)})' for n in track["assumes"]
                              if n in by)
            out.append(f"<p class=\"meta\">It assumes {named}, from another track.</p>")
        out.append("<ol>" + "".join(
            f'<li><a href="#lesson-{n}">{n} · {_inline(by[n].short)}</a> <span class="meta">'
            f'run time {cm.duration(by[n].quick_s)} quick, {cm.duration(by[n].full_s)} full; '
            f'{_needs(course, by[n].needs)}'
            f'</span></li>' for n in track["lessons"]) + "</ol></div>")
    off = [l for l in course["lessons"] if not any(l.number in t["lessons"] for t in course["tracks"])]
    if off:
        out.append("<p>On no track: " + ", ".join(f'<a href="#lesson-{l.number}">{l.number} · {_inline(l.short)}</a>'
                                                   for l in off) + ".</p>")
    out.append('</div>')
    return "".join(out)


def _meta(course: dict[str, Any], notebook: Path) -> str:
    """One line under a lesson's title: its time, its prerequisites, its tracks, and its seconds in this build."""
    info = course["by"].get(notebook.name[:2])
    if info is None:
        return ""
    cm = course["cm"]
    on = [re.sub(r"^The ", "the ", t["name"]) for t in course["tracks"] if info.number in t["lessons"]]
    ran = lesson_seconds(notebook)
    bits = [f"run time about {cm.duration(info.quick_s)} in quick mode, {cm.duration(info.full_s)} at full size",
            _needs(course, info.needs), ("on " + " and ".join(_inline(n) for n in on)) if on else "on no track"]
    if ran is not None:
        bits.append(f"ran in {ran:.0f} s for this page")
    return f'<p class="meta">{" · ".join(bits)}</p>'


def _text(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _first_png(cell: dict[str, Any]) -> bytes | None:
    for output in cell.get("outputs", []):
        data = output.get("data", {}).get("image/png")
        if data:
            return base64.b64decode("".join(data) if isinstance(data, list) else data)
    return None


def _widget_png(nb: dict[str, Any]) -> bytes | None:
    state = nb.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    images = [m for m in state.get("state", {}).values() if m.get("model_name") == "ImageModel" and m.get("buffers")]
    for model in reversed(images):
        buffer = model["buffers"][0]
        if buffer.get("encoding") == "base64" and buffer.get("data"):
            return base64.b64decode(buffer["data"])
    return None


def _first_sentence(markdown: str) -> str:
    text = " ".join(line.strip() for line in markdown.strip().split("\n\n")[0].splitlines())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text)[:300]


def _inline(markdown: str) -> str:
    """Escape for HTML; `code` and **bold** as tags."""
    text = html.escape(markdown, quote=True)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("executed", type=Path, help="folder of executed notebooks")
    parser.add_argument("site", type=Path, help="where index.html and figures/ go (beside the lessons' HTML)")
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    parser.add_argument("--times", type=Path, help="also write each lesson's seconds here (tab-separated)")
    parser.add_argument("--wall-s", type=float, help="the book's wall time, measured by make book")
    parser.add_argument("--tracks", type=Path, default=Path("notebooks/tracks.json"),
                        help="the course's tracks (skipped when absent)")
    parser.add_argument("--claims", type=Path, help="the claims log the executed lessons wrote: the folklore table")
    parser.add_argument("--map", type=Path, default=Path("notebooks/course_map.png"),
                        help="the course map's figure, drawn by tools/coursemap.py (skipped when absent)")
    args = parser.parse_args(argv)
    print(f"wrote {build(args.executed, args.site, args.readme, args.tracks, args.map, args.claims)}")
    if args.times:
        table = times_table(args.executed, args.wall_s)
        args.times.write_text(table)
        print(table.replace("\t", ": "), end="")
        spent = args.wall_s if args.wall_s is not None else float(table.splitlines()[-2].split("\t")[1])
        print(f"book: {spent / 60:.1f} min of a {BUDGET_S // 60} min budget: {'met' if spent <= BUDGET_S else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
