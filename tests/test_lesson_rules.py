"""The project's rules, read off every lesson: a timing claim is asserted only inside labkit.measure.gated, the
prose never speaks of "this machine's 2 cores" (a learner's machine has other counts; say what the code measured),
and the code never pins a literal core count above one (`cores=2` fails on a one-core machine: pin
`min(2, usable_cores())`). A wall-clock bound ("reported within the timeout + 5 s") is a timing claim like any other:
it may not stand in ALLOWED.

What counts as a timing claim: an `assert` (or a `claims.check("...", condition)`) whose condition reads a timing quantity, directly (a name like `step_s`,
`t_data_ms`, `median_ms`; a column like "ms per step", "cores busy", "others' cores"; a share, a bandwidth, a
speed, a throughput ratio such as `samples_per_s`) or through a name the notebook computed from one (`t4, t2 =
...time_s...`, then `assert t4 > 1.5 * t2`). An assert inside a function that the notebook passes to `gated(...)`
is checked by the gate and is fine. The few timing asserts allowed outside a gate are listed in ALLOWED, each with
its reason; an entry that no longer matches anything fails too, so the list cannot rot.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# Words (parts of a name split at "_", or of a string split at non-letters) that make a quantity a timing one.
TIMING_WORDS = {
    "ms", "us", "ns", "sec", "secs", "seconds", "time", "times", "elapsed", "latency", "duration", "downtime",
    "waited", "delay", "speed", "speedup", "faster", "slower", "throughput", "bandwidth", "busbw", "algbw", "gbps",
    "bw", "flops", "alpha", "busy", "others", "share", "cpu", "clock", "launch", "bubble",
}
TIMING_NAME = re.compile(r"(^t_|_(s|ms|us|ns)$|per_s(?![a-z]))")   # t_step, save_s, median_ms, samples_per_s
PER_SECOND = re.compile(r"/\s*s\b")                         # "samples/s"
N_WORD = r"(?:\d+|one|two|three|four|six|eight|a single)"
MACHINE_CORES = re.compile(rf"(?:this|the) machine(?:(?:'|\u2019)s|\s+has)\s+{N_WORD}\s+(?:cpu\s+)?cores?"
                           rf"|each rank has {N_WORD} (?:cpu )?cores?", re.I)

# (lesson stem, the assert's condition as ast.unparse writes it) -> why it may stand outside a gate.
ALLOWED: dict[tuple[str, str], str] = {
    ("18_pipeline_parallel", "(side['1F1B in flight'] == P).all()"):
        "microbatches in flight, counted from the actions' order, not a time (the table also holds bubble times)",
    ("18_pipeline_parallel", "(side[side.m > P]['1F1B MB'] < side[side.m > P]['GPipe MB']).all()"):
        "bytes of saved activations, counted by saved-tensor hooks, not a time",
    ('11_monitoring', 'gap < 1e-06'):
        "the largest difference between what TensorBoard's events hold and what the records hold, not a time",
    ('11_monitoring', 'monitor.clock_is_off(clocked_table, 1, SKEW)'):
        "a clock offset recovered from the records (the injected skew, 2.5 s, against 0.25 s of tolerance), not a "
        "speed: a busy core delays a step by milliseconds, both ranks alike",
    ("03_batch_size_and_scaling", "mb['tiny', 8] == mb['tiny', 128] and mb['small', 8] > 4 * mb['tiny', 8]"):
        "MB all-reduced per step: counted bytes, read from a table whose other columns are times",
    ("05_data_loading", "(busy < 1.05 * CORES + 0.05).all()"):
        "a bound of the meter itself: our processes cannot keep more cores busy than they are pinned to; other "
        "programs only lower it",
    ("05_data_loading", "(s > 0.9 * FLOOR_MS).all()"):
        "a floor, not a speed claim: the sample work cannot be spread over more cores than there are; other "
        "programs only make a step slower",
    ("05_data_loading", "cpu.between(0.75 * cpu.iloc[0], 1.5 * cpu.iloc[0]).all()"):
        "CPU seconds of work per step (the same work, whoever does it), not a rate: other programs on the cores "
        "do not add to our processes' CPU time",
    ("05_data_loading", "(w2['cores busy'] < 1.05 * CORES + 0.05).all() and (w2['t_step_ms'] > 0.9 * FLOOR_MS).all()"):
        "the meter's bound and the floor again, for two ranks (see the one-rank entries)",
    ("05_data_loading", "(pf_table['t_step_ms'] > 0.9 * FLOOR_MS).all()"):
        "the floor again, for the prefetch settings",
    ("16_build_ddp_yourself", "naive.first_launch > 1"):
        "an order of events, not a speed: the learner's naive version starts its all-reduces after backward has "
        "returned, so the first launch falls after backward's end however busy the cores are",
    ("05_data_loading", "0.95 * COST_MS <= cpu_ms <= 1.25 * COST_MS"):
        "the sample work's own CPU cost (thread CPU time of one call), which other programs do not change",
}


def code_cells(notebook: Path) -> list[str]:
    """The code cells' sources, IPython's %magics and !shell lines turned into comments so that ast can read them."""
    cells = json.loads(notebook.read_text())["cells"]
    return [re.sub(r"^(\s*)([%!])", r"\1pass  # \2", "".join(c["source"]), flags=re.M) for c in cells
            if c["cell_type"] == "code"]


def words_of(node: ast.AST, keywords: bool = False) -> set[str]:
    """The names, attributes and string constants an expression reads, as written. Left out: a called function's
    own name (`timing.time_wrappers(...)` is a measurement, not a timing quantity), its string arguments (labels,
    a claim's name), and unless `keywords`, its keyword arguments: in an assert they configure what is checked
    (`torch.equal(x, work(x, cost_ms=3))`), in an assignment they feed the value (`step_breakdown(run, alpha=a)`)."""
    out: set[str] = set()

    def visit(n: ast.AST) -> None:
        if isinstance(n, ast.Call):
            func = n.func
            if isinstance(func, ast.Attribute):
                visit(func.value)
            for arg in n.args:   # a string argument is a label or a claim's name
                if not isinstance(arg, (ast.Constant, ast.JoinedStr)):
                    visit(arg)
            for keyword in n.keywords if keywords else ():
                visit(keyword.value)
            return
        if isinstance(n, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            bound = {name for g in n.generators for name in _targets(g.target)}
            inner = [n.key, n.value] if isinstance(n, ast.DictComp) else [n.elt]
            out.update(w for part in [*inner, *[i for g in n.generators for i in g.ifs]]
                       for w in words_of(part, keywords) if w not in bound)   # its own loop variables are local
            for g in n.generators:
                visit(g.iter)
            return
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(QUOTE + n.value)   # a string: timing by its words, never a name computed from a timing
        for child in ast.iter_child_nodes(n):
            visit(child)
    visit(node)
    return out


QUOTE = "\x00"   # marks a string constant among the names words_of returns


def is_timing_word(word: str) -> bool:
    word = word.removeprefix(QUOTE)
    if TIMING_NAME.search(word.lower()) or PER_SECOND.search(word):
        return True
    return bool(set(re.split(r"[^a-z0-9]+", word.lower())) & TIMING_WORDS)


def _targets(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List, ast.Starred)):
        elements = target.elts if not isinstance(target, ast.Starred) else [target.value]
        return [name for element in elements for name in _targets(element)]
    return []   # x[k] = ... or x.a = ...: the container is not renamed


def gated_functions(trees: list[ast.Module]) -> set[str]:
    """Names of the functions the notebook hands to gated(...) (the claim's check), and of the notebook's functions
    those call (a check made of smaller checks)."""
    out, calls = set(), {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "gated":
                out |= {arg.id for arg in [*node.args, *[k.value for k in node.keywords]] if isinstance(arg, ast.Name)}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls[node.name] = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call)
                                    and isinstance(c.func, ast.Name)}
    while True:
        more = {callee for name in out for callee in calls.get(name, ()) if callee in calls} - out
        if not more:
            return out
        out |= more


def check_condition(node: ast.AST) -> ast.AST | None:
    """The condition of a lesson's `claims.check("claim", condition, measured=...)` (or `check(...)`), else None."""
    if not isinstance(node, ast.Call) or getattr(node.func, "id", getattr(node.func, "attr", None)) != "check":
        return None
    if len(node.args) >= 2:
        return node.args[1]
    return next((k.value for k in node.keywords if k.arg == "ok"), None)


def ungated_timing_asserts(cells: list[str]) -> list[str]:
    """Each `assert` condition, or condition of a `claims.check(...)`, that reads a timing quantity outside a function handed to gated(...).

    The cells are read top to bottom, as they run: a name assigned from a timing quantity (or from such a name)
    is a timing name until it is assigned something else (`s` may be a step time in one cell, a table in the next)."""
    trees = [ast.parse(source) for source in cells]
    checks = gated_functions(trees)
    tainted: set[str] = set()
    found = []

    def timing(node: ast.AST, keywords: bool = False) -> bool:
        # An UPPER_CASE name is a knob the lesson sets (COST_MS = 8): timing only if computed from a measurement.
        return any((is_timing_word(w) and not w.isupper()) or w in tainted for w in words_of(node, keywords))

    def bind(targets: list[ast.AST], value: ast.AST) -> None:
        pairs = [(t, value) for t in targets]
        for target, val in pairs:   # a, b = x, y: element by element
            if isinstance(target, ast.Tuple) and isinstance(val, ast.Tuple) and len(target.elts) == len(val.elts):
                pairs += list(zip(target.elts, val.elts))
                continue
            bind_one(_targets(target), val)

    def bind_one(names: list[str], value: ast.AST) -> None:
        if timing(value, keywords=True):
            tainted.update(names)
        else:
            tainted.difference_update(names)

    def visit(node: ast.AST, inside_gate: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside_gate = inside_gate or node.name in checks
        elif isinstance(node, ast.Assign):
            bind(node.targets, node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            if not (isinstance(node, ast.AugAssign) and timing(node.target)):   # t += x: still a timing name
                bind([node.target], node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            bind([node.target], node.iter)
        elif isinstance(node, ast.Assert) and not inside_gate and timing(node.test):
            found.append(ast.unparse(node.test))
        elif (condition := check_condition(node)) is not None and not inside_gate and timing(condition):
            found.append(ast.unparse(condition))
        for child in ast.iter_child_nodes(node):
            if isinstance(node, (ast.For, ast.AsyncFor)) and child is node.target:
                continue
            visit(child, inside_gate)
    for tree in trees:
        visit(tree, False)
    return found


CORE_KNOB = re.compile(r"(^|_)(cores?|cpus?)$", re.I)
WALL_CLOCK = {"seconds", "elapsed", "wall", "wall_s", "duration"}


def literal_core_counts(cells: list[str]) -> list[str]:
    """Each place a lesson's code fixes a core count above one as a literal: `cores=2` passed to a call, or `CORES = 2`
    assigned. One core is on every machine; two are not."""
    found = []
    for tree in (ast.parse(source) for source in cells):
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.Call):
                pairs = [(k.arg, k.value) for k in node.keywords if k.arg]
            elif isinstance(node, ast.Assign):
                pairs = [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
            for name, value in pairs:
                if (CORE_KNOB.search(name) and isinstance(value, ast.Constant) and type(value.value) is int
                        and value.value > 1):
                    found.append(f"{name}={value.value}")
    return found


def machine_cores_claims(notebook: Path) -> list[str]:
    """Sentences (markdown or code) that state this machine's core count as a literal."""
    cells = json.loads(notebook.read_text())["cells"]
    return [m.group(0) for c in cells for m in MACHINE_CORES.finditer("".join(c["source"]))]


LESSONS = sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if not p.name.endswith(".blank.ipynb"))


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_timing_assert_goes_through_the_gate(lesson):
    found = [a for a in ungated_timing_asserts(code_cells(lesson)) if (lesson.stem, a) not in ALLOWED]
    assert not found, (f"{lesson.name}: timing claims asserted outside labkit.measure.gated (gate them, assert "
                       f"what was counted instead, or allow them in ALLOWED with a reason): {found}")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_no_lesson_pins_a_literal_core_count(lesson):
    found = literal_core_counts(code_cells(lesson))
    assert not found, f"{lesson.name}: pin CORES = min(2, usable_cores()) instead of {found}"


def test_no_wall_clock_bound_is_allowed_outside_the_gate():
    wall = [key for key in ALLOWED if set(re.split(r"[^a-z_]+", key[1].lower())) & WALL_CLOCK]
    assert not wall, f"wall-clock asserts belong in a gated claim, not in ALLOWED: {wall}"


def test_every_allowed_exception_still_exists_and_says_why():
    present = {(p.stem, a) for p in LESSONS for a in ungated_timing_asserts(code_cells(p))}
    stale = [key for key in ALLOWED if key not in present]
    assert not stale, f"ALLOWED entries that match no assert any more (remove them): {stale}"
    assert all(len(reason) > 20 for reason in ALLOWED.values())


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_no_lesson_states_this_machines_core_count(lesson):
    assert not machine_cores_claims(lesson), (f"{lesson.name}: say what the code measured (usable cores) or pin "
                                              f"as lessons 03 and 05 do: {machine_cores_claims(lesson)}")


# --- the rule, shown to catch what it is for -----------------------------------------------------------------

def _notebook(tmp_path: Path, *cells: tuple[str, str]) -> Path:
    path = tmp_path / "99_planted.ipynb"
    path.write_text(json.dumps({"cells": [{"cell_type": kind, "source": text, "metadata": {}} for kind, text in cells],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_a_planted_ungated_timing_assert_is_caught(tmp_path):
    planted = _notebook(tmp_path, ("code", "%matplotlib inline\nt2, t4 = (float(d.time_s[9]) for d in (a, b))\n"
                                           "ratio = t4 / t2\nassert ratio > 1.5, ratio\n"
                                           "assert table['cores busy'].iloc[1] < 1.4\n"
                                           "COST_MS = 8\nassert torch.equal(x, work(x, cost_ms=COST_MS))\n"
                                           "FP32_WIRE_SHARE = wire.loc['fp32', 'share of a step']\n"
                                           "assert FP32_WIRE_SHARE < 0.25\n"
                                           "ratio = len(counts)\nassert ratio == 3\n"
                                           "assert same['samples_per_s'] < 1.4\n"
                                           "one_per_step = len(calls)\nassert one_per_step == 1\n"
                                           "assert run.finished and len(counts) == 3\n"))
    assert ungated_timing_asserts(code_cells(planted)) == [
        "ratio > 1.5", "table['cores busy'].iloc[1] < 1.4", "FP32_WIRE_SHARE < 0.25", "same['samples_per_s'] < 1.4"]


def test_a_planted_ungated_timing_check_is_caught(tmp_path):
    planted = _notebook(tmp_path, ("code", "t2, t4 = (float(d.time_s[9]) for d in (a, b))\n"
                                           "claims.check('4 ranks are slower', t4 > 1.5 * t2, measured=t4 / t2)\n"
                                           "check('the same loss', gap < 1e-5, measured=t4)\n"
                                           "claims.check('fast', ok=table['step_ms'].max() < 3)\n"))
    assert ungated_timing_asserts(code_cells(planted)) == ["t4 > 1.5 * t2", "table['step_ms'].max() < 3"]


def test_the_same_assert_inside_a_gated_check_passes(tmp_path):
    gated_nb = _notebook(tmp_path, ("code", "def slower(timed):\n"
                                           "    assert timed['w4'].step_s > 1.5 * timed['w2'].step_s\n"
                                           "def oversubscription_costs(timed):\n    slower(timed)\n"
                                           "outcome = gated('02: w4 is slower', oversubscription_costs, timed)\n"
                                           "assert outcome.status in ('checked', 'skipped')\n"))
    assert ungated_timing_asserts(code_cells(gated_nb)) == []


def test_a_planted_core_count_sentence_is_caught(tmp_path):
    planted = _notebook(tmp_path, ("markdown", "4 ranks oversubscribe this machine's 2 cores; "
                                               "each rank has a single CPU core. This machine has 2 CPU cores."),
                        ("markdown", "pinned to the 2 cores that `usable_cores()` found"))
    assert machine_cores_claims(planted) == ["this machine's 2 cores", "each rank has a single CPU core",
                                             "This machine has 2 CPU cores"]


def test_a_planted_literal_core_count_and_wall_clock_bound_are_caught(tmp_path):
    planted = _notebook(tmp_path, ("code", "CORES = 2\nrun = metered(lambda: go(), cores=2)\nfixes = two_fixes(n_cpus=4)\n"
                                           "ok = metered(go, cores=CORES)\nalso = metered(go, cores=1)\n"
                                           "out = labkit.launch(cfg)\nassert out.seconds < TIMEOUT + 5\n"))
    assert literal_core_counts(code_cells(planted)) == ["CORES=2", "cores=2", "n_cpus=4"]
    assert ungated_timing_asserts(code_cells(planted)) == ["out.seconds < TIMEOUT + 5"]
