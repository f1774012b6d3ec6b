"""The package's layout is its architecture: rooms in a fixed order, every import arrow pointing down, no circles.

    base (config, fault, rules, records) <- training, view <- run <- measure <- tricks <- the face (__init__, cli, __main__)

train and view stand side by side: the training loop never imports plotting, and figures know nothing of training.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "labkit"
ROOMS = {"base": 0, "training": 1, "view": 1, "run": 2, "measure": 3, "tricks": 4, "face": 5}
BASE = {"labkit.config", "labkit.fault", "labkit.rules", "labkit.records"}
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


def test_the_readme_layout_names_every_room():
    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    rooms = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms and all(f"  {room}/" in layout for room in rooms), rooms
    for module in (p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")):
        assert module in layout, f"README's layout does not mention labkit/{module}"
