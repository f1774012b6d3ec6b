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
