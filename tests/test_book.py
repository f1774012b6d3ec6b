"""`make book`'s front page, built from executed notebooks in a temp dir (no lesson is executed here)."""
from __future__ import annotations

import base64
import importlib.util
import io
import json
import re
from pathlib import Path

import nbformat
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("book", ROOT / "tools" / "book.py")
book = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book)


def _png(color: str) -> bytes:
    fig = Figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1], color=color)
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def _executed(path: Path, title: str, intro: str, cells: list[tuple[str, bytes | None, list[str]]]) -> None:
    """A notebook as nbconvert leaves it after executing: code cells with their image outputs."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\n{intro}\n\nMore text.")]
    for source, png, tags in cells:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": tags} if tags else {})
        if png is not None:
            cell.outputs = [nbformat.v4.new_output("display_data",
                                                   data={"image/png": base64.b64encode(png).decode()})]
        nb.cells.append(cell)
    nbformat.write(nb, path)


def test_the_index_lists_the_lessons_in_order_with_summary_and_headline_figure(tmp_path):
    executed, site = tmp_path / "executed", tmp_path / "site"
    executed.mkdir()
    first, chosen, tagged = _png("red"), _png("blue"), _png("green")
    _executed(executed / "01_second.ipynb", "01 · Second lesson", "Its intro. Goes on.",
              [("x = 1", first, []), ("labkit.compare([a, b])", chosen, [])])
    _executed(executed / "00_first.ipynb", "00 · First lesson", "Ignored: README has a row.",
              [("plot()", first, []), ("plot()", tagged, ["headline"])])
    _executed(executed / "02_no_figure.ipynb", "02 · Words only", "Nothing drawn here!", [("print(1)", None, [])])
    _executed(executed / "16_x.blank.ipynb", "blank copy", "never listed", [])
    readme = tmp_path / "README.md"
    readme.write_text("| notebook | what it shows |\n|---|---|\n"
                      "| `00_first.ipynb` | The first: `code` and **bold** |\n")

    index = book.build(executed, site, readme)
    page = index.read_text()
    titles = re.findall(r"<h2><a href=\"([^\"]+)\">([^<]+)</a></h2>", page)
    assert titles == [("00_first.html", "00 · First lesson"), ("01_second.html", "01 · Second lesson"),
                      ("02_no_figure.html", "02 · Words only")]
    assert "The first: <code>code</code> and <b>bold</b>" in page       # README's row
    assert "<p>Its intro.</p>" in page and "<p>Nothing drawn here!</p>" in page  # else the first sentence
    assert (site / "figures" / "00_first.png").read_bytes() == tagged      # the tagged cell's figure
    assert (site / "figures" / "01_second.png").read_bytes() == chosen     # else the compare(...) cell's
    assert not (site / "figures" / "02_no_figure.png").exists() and page.count("<img") == 2
    assert "blank copy" not in page


def test_the_playground_headline_is_the_figure_its_panel_showed(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 15 · Playground\n\nKnobs.")]
    png = _png("black")
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"m1": {
        "model_name": "ImageModel", "state": {},
        "buffers": [{"path": ["value"], "encoding": "base64", "data": base64.b64encode(png).decode()}]}}}}
    assert book.headline(json.loads(nbformat.writes(nb))) == png


def test_every_lesson_has_a_title_and_a_summary():
    rows = book.readme_table(ROOT / "README.md")
    for notebook in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        if notebook.name.endswith(".blank.ipynb"):
            continue
        info = book.lesson(notebook, rows)
        assert info["title"] != notebook.stem and info["title"][:2] == notebook.name[:2], info
        assert len(info["summary"]) > 20, info


def test_make_book_executes_each_lesson_once_then_writes_the_index():
    import subprocess
    commands = subprocess.run(["make", "-n", "book"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.replace("\\\n", " ")
    executing = next(line for line in commands.splitlines() if "--execute" in line)
    assert commands.count("--execute") == 1 and "tools/book.py site/executed site" in commands
    lessons = [p.name for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.endswith(".blank.ipynb")]
    assert lessons and all(f"notebooks/{name}" in executing for name in lessons)
    assert ".blank.ipynb" not in executing
    # the claims the lessons log while executing are the folklore table's evidence: a fresh log, read by book.py
    assert "rm -f site/claims.jsonl" in commands and "LABKIT_CLAIMS_LOG=" in executing
    assert "site/claims.jsonl" in executing and "--claims site/claims.jsonl" in commands


def test_with_tracks_the_index_opens_with_the_map_and_each_track_with_times_and_prerequisites(tmp_path):
    executed, site = tmp_path / "executed", tmp_path / "site"
    executed.mkdir()
    header = "{intro}\n\n**You need**: {need}\n\n**Run time**: about {q} s in quick mode, {f} min at full size."
    _executed(executed / "00_first.ipynb", "00 · First: runs", header.format(intro="One.", need="Python.", q=10, f=1),
              [("labkit.compare([a])", _png("red"), [])])
    _executed(executed / "01_second.ipynb", "01 · Second: more", header.format(intro="Two.", need="lesson 00.", q=20, f=2),
              [("x = 1", None, [])])
    _executed(executed / "02_third.ipynb", "02 · Third", header.format(intro="Three.", need="lesson 01.", q=30, f=3), [])
    tracks = tmp_path / "tracks.json"
    tracks.write_text(json.dumps({"tracks": [
        {"id": "a", "name": "Track A", "goal": "you want A", "lessons": ["00", "01"], "assumes": []},
        {"id": "b", "name": "Track B", "goal": "you want B", "lessons": ["02"], "assumes": ["01"]}]}))
    course_map = tmp_path / "map.png"
    course_map.write_bytes(_png("blue"))

    page = book.build(executed, site, tmp_path / "no-readme.md", tracks, course_map).read_text()
    assert (site / "figures" / "course_map.png").read_bytes() == course_map.read_bytes()
    assert page.index('src="figures/course_map.png"') < page.index("Track A") < page.index("Track B")
    assert "2 lessons, run time about 30 s in quick mode, 3 min at full size" in page        # 10 s + 20 s, 1 + 2 min
    assert re.search(r'01 · Second</a> <span class="meta">run time 20 s quick, 2 min full; needs <a href="#lesson-00">00</a>',
                     page)
    assert "It assumes <a href=\"#lesson-01\">01</a> (Second), from another track." in page
    assert re.search(r'<div class="lesson" id="lesson-02"><h2><a href="02_third.html">02 · Third</a></h2>'
                     r'<p class="meta">run time about 30 s in quick mode, 3 min at full size · needs <a href="#lesson-01">01</a>'
                     r' · on Track B</p><p>Three.</p>', page)
    titles = re.findall(r"<h2><a href=\"([^\"]+)\">([^<]+)</a></h2>", page)
    assert [t for _, t in titles] == ["00 · First: runs", "01 · Second: more", "02 · Third"]   # still in order
    assert page.count("<img") == 2                                                  # the map, and 00's figure


def test_the_real_lessons_index_shows_every_track_and_every_lesson(tmp_path):
    """The committed (unexecuted) notebooks stand in for executed ones: headers are all the map reads."""
    page = book.build(ROOT / "notebooks", tmp_path / "site", ROOT / "README.md", ROOT / "notebooks" / "tracks.json",
                      ROOT / "notebooks" / "course_map.png").read_text()
    tracks = json.loads((ROOT / "notebooks" / "tracks.json").read_text())["tracks"]
    for track in tracks:
        assert f'id="track-{track["id"]}"' in page
        listed = re.search(rf'id="track-{track["id"]}".*?<ol>(.*?)</ol>', page).group(1)
        assert re.findall(r'<li><a href="#lesson-(\d\d)">', listed) == track["lessons"]
    lessons = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9]*.ipynb") if not p.name.endswith(".blank.ipynb"))
    assert re.findall(r'<div class="lesson" id="lesson-(\d\d)">', page) == lessons
    assert page.count('<p class="meta">run time about ') == len(lessons)


def test_with_a_claims_log_the_index_judges_the_folklore_by_it_and_ends_with_the_glossary(tmp_path):
    """The folklore table on the index is built from the log given (one claim checked, the rest absent), and the
    glossary follows the lessons."""
    log = tmp_path / "claims.jsonl"
    log.write_text(json.dumps({"claim": "08: one seed twice: every record equal, bit for bit", "status": "checked",
                               "measured": "24 records compared", "kind": "check"}) + "\n")
    page = book.build(ROOT / "notebooks", tmp_path / "site", ROOT / "README.md", ROOT / "notebooks" / "tracks.json",
                      ROOT / "notebooks" / "course_map.png", log).read_text()
    folklore = page[page.index("The folklore, judged"):page.index('<div class="lesson"')]
    assert page.index('id="track-') < page.index("The folklore, judged") < page.index('<div class="lesson"')
    # the lessons' heading heads the lessons, not the folklore table (it sat above the table once)
    assert page.index("The folklore, judged") < page.index('<h2 id="lessons">Every lesson</h2>') \
        < page.index('<div class="lesson"')
    assert "神操作4：全局设定随机种子" in folklore and "24 records compared" in folklore
    assert folklore.count("not checked") > 10              # the claims this log lacks decide nothing
    assert page.index("Glossary · 术语表") > page.rindex('<div class="lesson"')
