"""What a lesson or a README shows a reader imports as written, lessons reach only the public face, and the
run directory's file names are spelled in one module."""
import ast
import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "labkit"
LESSONS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.endswith(".blank.ipynb"))
INSIDES = ("labkit.training", "labkit.run", "labkit.view", "labkit.app", "labkit.cli")
DOTTED = re.compile(r"\blabkit(?:\.[A-Za-z_]\w*)+")


def cells(notebook: Path) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(notebook.read_text())["cells"]]


def imported_modules(source: str) -> set[str]:
    """labkit modules a code cell imports (IPython magics and shell lines read as `pass`)."""
    code = "\n".join(line[:len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("labkit"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("labkit"))
    return found


def resolves(dotted: str) -> bool:
    """Whether `labkit.a.b.c` is a module, or a module's attribute (chain), as a reader would use it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def shown_paths() -> dict[str, set[str]]:
    """Every dotted labkit path in the lessons (code and prose) and the README, by where it was seen."""
    seen: dict[str, set[str]] = {}
    for lesson in LESSONS:
        for _, source in cells(lesson):
            for path in DOTTED.findall(source):
                seen.setdefault(path.rstrip("."), set()).add(lesson.name)
    for path in DOTTED.findall((ROOT / "README.md").read_text()):
        seen.setdefault(path.rstrip("."), set()).add("README.md")
    return seen


def test_every_labkit_path_a_lesson_or_the_readme_shows_imports_as_written():
    broken = {path: sorted(where) for path, where in shown_paths().items() if not resolves(path)}
    assert not broken, f"paths shown to readers that do not import: {broken}"


# A file of this repository named by its path ("`labkit/app/panel.py` explains why", "tests/test_nodes.py runs..."):
# a reader opens it, so after a move the text must follow. Generated folders (runs/, site/) are not named here.
FILE_PATH = re.compile(r"(?<![\w/.])(?:labkit|tests|tools|bench|scripts)/[\w/.-]*\w\.(?:py|ipynb|sbatch|yaml|md|txt)\b")


def shown_files() -> dict[str, set[str]]:
    """Every repository file path in the lessons (code and prose) and the README, by where it was seen."""
    texts = {lesson.name: "\n".join(source for _, source in cells(lesson)) for lesson in LESSONS}
    texts["README.md"] = (ROOT / "README.md").read_text()
    seen: dict[str, set[str]] = {}
    for where, text in texts.items():
        for path in FILE_PATH.findall(text):
            seen.setdefault(path, set()).add(where)
    return seen


def missing_files(seen: dict[str, set[str]]) -> dict[str, list[str]]:
    return {path: sorted(where) for path, where in seen.items() if not (ROOT / path).is_file()}


def test_every_file_path_a_lesson_or_the_readme_names_exists():
    missing = missing_files(shown_files())
    assert not missing, f"files named to readers that are not there (moved?): {missing}"


def test_the_file_path_reader_sees_slash_paths_and_not_run_files():
    text = ("see `labkit/training/held.py`, labkit/app/panel.py: and tests/test_nodes.py; runs/x/rank0.jsonl, "
            "a.labkit/b.py")
    assert FILE_PATH.findall(text) == ["labkit/training/held.py", "labkit/app/panel.py", "tests/test_nodes.py"]
    assert missing_files({"labkit/training/no_such_module.py": {"13.ipynb"}, "labkit/rundir.py": {"README.md"}}) == \
        {"labkit/training/no_such_module.py": ["13.ipynb"]}


def test_the_resolver_tells_a_broken_path_from_a_good_one():
    assert resolves("labkit.memory.model_state_bytes") and resolves("labkit.exercises.check_ddp")
    assert not resolves("labkit.tricks.memory") and not resolves("labkit.RunConfig.no_such_field")


def test_the_names_issue_18_promised_import():
    from labkit.memory import model_state_bytes  # noqa: F401
    import labkit.exercises  # noqa: F401
    from labkit.measure import usable_cores
    assert usable_cores() >= 1


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_imports_only_the_public_face(lesson):
    inside = sorted(m for kind, source in cells(lesson) if kind == "code" for m in imported_modules(source)
                    if m.startswith(INSIDES))
    assert not inside, f"{lesson.name} imports {inside}: use labkit, labkit.tricks.<family>, labkit.measure, " \
                       "labkit.exercises"


def test_the_import_reader_sees_an_inside_import():
    assert imported_modules("%matplotlib inline\nfrom labkit.training.tasks import make_task\nimport labkit") == \
        {"labkit.training.tasks", "labkit"}


# --- the run directory's names: one owner ------------------------------------------------------------------------

# Anywhere in a string, not only a whole one: "full text in rank{r}.log" inside a message spells the name too.
RUN_FILES = re.compile(r"(\.jsonl\b|\.error\.json\b|\bmeta\.json\b|\bconfig\.json\b|\bfailure\.txt\b"
                       r"|\b(rank|result)\{\}\.)")
RESERVED_DIRS = {"final", "tb", "attempts", "checkpoints"}  # flagged where a path is built with them: run_dir / "tb"
OWNERS_OF_THEIR_OWN = {
    "labkit/training/state/checkpoint.py": "owns the inside of checkpoints/ (step_*/, manifest.json, saves.jsonl, "
                                           "rank<r>.pt shards): a format of its own, documented there",
}


def run_file_literals(path: Path) -> list[str]:
    """String constants (docstrings aside) and f-string shapes in `path` that spell a run-directory file name."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    inside_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = [n.right.value for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
             and isinstance(n.right, ast.Constant) and n.right.value in RESERVED_DIRS]
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            shape = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            if RUN_FILES.search(shape):
                found.append(shape)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and id(node) not in inside_fstrings:
            if RUN_FILES.search(node.value):
                found.append(node.value)
    return found


def test_run_directory_file_names_are_spelled_in_rundir_only():
    spelled = {str(p.relative_to(ROOT)): run_file_literals(p) for p in PACKAGE.rglob("*.py")
               if p.name != "rundir.py" and str(p.relative_to(ROOT)) not in OWNERS_OF_THEIR_OWN}
    spelled = {p: names for p, names in spelled.items() if names}
    assert not spelled, f"ask labkit.rundir.RunDir for these paths instead: {spelled}"


def test_the_file_name_check_sees_a_spelled_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""rank<r>.jsonl in a docstring is fine."""\n'
                       'def f(d, r):\n    return d / f"rank{r}.log", d / "meta.json", d / "final"\n'
                       'def g(r, detail):\n'
                       '    return f"rank {r} saw {detail}; full text in rank{r}.log", "see meta.json"\n')
    assert sorted(run_file_literals(planted)) == ["final", "meta.json", "rank {} saw {}; full text in rank{}.log",
                                                  "rank{}.log", "see meta.json"]


def test_the_runs_root_default_has_one_owner():
    """LABKIT_RUNS is read in rundir.py alone (runs_root()); every other module asks it."""
    readers = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if p.name != "rundir.py" and '"LABKIT_RUNS"' in p.read_text()]
    assert not readers, f"these read LABKIT_RUNS themselves: {readers}; call labkit.rundir.runs_root()"


def test_cli_is_argument_parsing_only():
    source = (PACKAGE / "cli.py").read_text()
    tree = ast.parse(source)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.startswith("torch")}, "cli.py should not touch torch: the rank's life is run/"
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    too_long = [f.name for f in functions if f.end_lineno - f.lineno > 25]
    assert not too_long, f"cli.py functions longer than argument handling needs: {too_long}"


def imported_names(source: str) -> set[str]:
    """`labkit.module.name` for every `from labkit.module import name` in a code cell."""
    code = "\n".join(line[:len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())
    return {f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("labkit")
            for alias in node.names}


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_name_a_lesson_imports_from_labkit_exists(lesson):
    """`from labkit.tricks import memory` after memory moved is an ImportError only when the cell runs: catch it here."""
    missing = sorted(n for kind, source in cells(lesson) if kind == "code" for n in imported_names(source)
                     if not resolves(n))
    assert not missing, f"{lesson.name} imports names that do not exist: {missing}"
