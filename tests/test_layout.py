"""The package's layout is its architecture: rooms in a fixed order, every import arrow pointing down, no circles.

    base (config, constraints, fault, rules, display, rundir, records, context, memory) <- training, view <- run
        <- measure, app <- tricks <- exercises <- the face (__init__, cli, __main__)

Rooms on one floor stand side by side and never import each other: the training loop never imports plotting and
figures know nothing of training; the control panel (app/) and the honest-speed tools (measure/) need neither.
"""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "labkit"
ROOMS = {"base": 0, "training": 1, "view": 1, "run": 2, "measure": 3, "app": 3, "tricks": 4, "exercises": 5,
         "face": 6}
BASE = {"labkit.config", "labkit.constraints", "labkit.dims", "labkit.modes", "labkit.fault", "labkit.rules", "labkit.display", "labkit.context", "labkit.rundir", "labkit.records",
        "labkit.memory"}
FACE = {"labkit", "labkit.cli", "labkit.__main__"}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """labkit modules `name` imports, lazily (inside functions) or not."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            stem = (package[:len(package) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            stem = [part for part in stem if part]
            for alias in node.names:
                full = ".".join(stem + [alias.name])
                found.add(full if full in known else ".".join(stem))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def room(name: str) -> str:
    if name in BASE:
        return "base"
    if name in FACE:
        return "face"
    parts = name.split(".")
    assert len(parts) >= 2 and parts[1] in ROOMS, f"{name} is in no room: put it in one of {sorted(ROOMS)}"
    return parts[1]


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


def test_every_module_is_in_a_room():
    for name in GRAPH:
        room(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_point_down_or_stay_in_the_room(name):
    upward = [target for target in GRAPH[name] if room(target) != room(name)
              and ROOMS[room(target)] >= ROOMS[room(name)]]
    assert not upward, f"{name} ({room(name)}) imports {upward}: a room may import only rooms below it"


def test_there_is_no_import_circle():
    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            for nxt in GRAPH[todo.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False
    circles = sorted({tuple(sorted((a, b))) for a in GRAPH for b in GRAPH[a] if reaches(b, a)})
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path):
    """The two rules above can fail: a lazy import inside a function counts."""
    fake = {"labkit.training.a": tmp_path / "a.py", "labkit.view.b": tmp_path / "b.py"}
    fake["labkit.training.a"].write_text("def f():\n    from ..view.b import g\n")
    fake["labkit.view.b"].write_text("from ..training.a import f\n")
    graph = {name: imports(name, path, fake) for name, path in fake.items()}
    assert graph == {"labkit.training.a": {"labkit.view.b"}, "labkit.view.b": {"labkit.training.a"}}


def test_every_room_of_the_package_is_known_here():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ROOMS) - {"base", "face"}, f"rooms on disk {sorted(rooms)}; ROOMS knows {sorted(ROOMS)}"


def readme_layout() -> str:
    readme = (PACKAGE.parent / "README.md").read_text()
    start = readme.index("## Layout")
    return readme[start:readme.index("\n## ", start + 1)] if "\n## " in readme[start + 1:] else readme[start:]


def layout_entries(layout: str) -> dict[str, str]:
    """The layout block's entries under labkit/, by path: {"training/parallel/": "how the model is spread ... held
    (bytes held), ...", "config.py": "the base: RunConfig ...", ...}. An entry is a line indented less than the
    description column (its name, then two spaces or more, then text); deeper lines continue the entry above; a
    folder's path comes from the entries it is indented under."""
    block = layout.split("```")[1]
    entries: dict[str, str] = {}
    parents: list[tuple[int, str]] = []      # (indent, folder path) of the folders the current line sits in
    current: list[str] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent >= 8:                      # a continuation of the entry above
            for key in current:
                entries[key] += " " + line.strip()
            continue
        names, _, text = line.strip().partition("  ")
        parents = [(i, p) for i, p in parents if i < indent]
        prefix = parents[-1][1] if parents else ""
        current = [prefix + name.strip() for name in names.split(",")]
        for key in current:
            entries[key] = text.strip()
            if key.endswith("/"):
                parents.append((indent, key))
    return {key.removeprefix("labkit/"): text for key, text in entries.items()
            if key.startswith("labkit/") and key != "labkit/"}


def names(stem: str, text: str) -> bool:
    """Whether `text` names `stem` as a whole word (`data` in "loop, data, lr", not in "metadata")."""
    return re.search(rf"(?<![\w]){re.escape(stem)}(?![\w])", text) is not None


def missing_from_layout(paths: list[Path], entries: dict[str, str]) -> list[str]:
    """Modules and folders of labkit/ (given relative to it) that the layout's entries do not name: a folder needs
    an entry of its own (training/parallel/), a top-level module one named after its file (config.py), and a module
    in a folder its stem, as a word, in that folder's entry."""
    missing = []
    for rel in paths:
        if rel.name in ("__init__.py", "__main__.py"):
            folder = rel.parent
            if folder.parts and f"{folder.as_posix()}/" not in entries:
                missing.append(f"labkit/{folder.as_posix()}/")
        elif len(rel.parts) == 1:
            if rel.name not in entries:
                missing.append(f"labkit/{rel}")
        elif not names(rel.stem, entries.get(f"{rel.parent.as_posix()}/", "")):
            missing.append(f"labkit/{rel}")
    return missing


def test_the_readme_layout_names_every_room_folder_and_module():
    """Nested folders too (training/parallel/, training/state/): a newcomer reads the README to find a file, under
    the folder it is in."""
    paths = sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py"))
    missing = missing_from_layout(paths, layout_entries(readme_layout()))
    assert not missing, f"README's layout does not name these where they are: {missing}"


def test_the_layout_check_wants_whole_words_in_the_right_folder():
    entries = layout_entries("```\nlabkit/        the package\n  config.py, fault.py   the base\n"
                             "  training/      the loop, metadata and\n"
                             "                 lr (schedules)\n    state/       checkpoint\n  view/   a report\n```")
    assert entries == {"config.py": "the base", "fault.py": "the base", "training/": "the loop, metadata and lr "
                       "(schedules)", "training/state/": "checkpoint", "view/": "a report"}
    paths = [Path(p) for p in ("config.py", "rules.py", "training/__init__.py", "training/loop.py", "training/lr.py",
                               "training/data.py", "training/state/__init__.py", "training/state/checkpoint.py",
                               "training/report.py", "run/__init__.py")]
    assert missing_from_layout(paths, entries) == ["labkit/rules.py", "labkit/training/data.py",
                                                   "labkit/training/report.py", "labkit/run/"]


def test_the_room_rules_see_an_unknown_room():
    with pytest.raises(AssertionError, match="in no room"):
        room("labkit.attic.thing")
