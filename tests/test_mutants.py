"""tools/mutants.py: the mutants it makes of a solution, how it judges a report, and its table (no rank runs here;
`python tools/mutants.py run` runs the checkers)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from labkit.exercises.report import Report

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutants", ROOT / "tools" / "mutants.py")
mutants = importlib.util.module_from_spec(spec)
sys.modules["mutants"] = mutants   # its dataclasses look their module up
spec.loader.exec_module(mutants)

SOLUTION = '''
class MyDDP:
    def finish(self, grads, work):
        """Average."""
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.SUM)
            g /= 2
        work.wait()
        return grads[0] if len(grads) == 1 else grads


def shift(x, rank, world):
    return dist.send(x[rank], dst=(rank + 1) % world)
'''


def test_each_operator_makes_its_mutant_and_each_mutant_changes_one_function():
    made = mutants.mutants(SOLUTION)
    kinds = {m.operator for m in made}
    assert {"binop", "compare", "number", "index", "reduceop", "peer", "drop", "double"} <= kinds, kinds
    assert {m.function for m in made} == {"MyDDP.finish", "shift"}
    drop_wait = [m for m in made if m.operator == "drop" and "work.wait()" in m.before]
    assert len(drop_wait) == 1 and "work.wait()" not in drop_wait[0].source
    assert any(m.operator == "reduceop" and "ReduceOp.MAX" in m.source for m in made)
    assert any(m.operator == "peer" and "dst=(rank + 1) % world + 1" in m.source for m in made)
    assert all(m.source != SOLUTION for m in made) and len({m.id for m in made}) == len(made)
    assert not any(m.operator in ("drop", "double") and '"""' in m.before for m in made)   # docstrings left alone
    for m in made:
        compile(m.source, m.id, "exec")


def test_a_report_blames_the_mutated_function_by_its_method_or_class_name():
    report = Report("x")
    report.add("values", "fail", "gradients are summed, not averaged: 2.000x", part="MyDDP.finish")
    assert mutants.blames(report, "MyDDP.finish") and mutants.blames(report, "finish")
    assert not mutants.blames(report, "shift")
    quiet = Report("y")
    quiet.add("values", "fail", "off by 1.0")
    assert quiet.blamed == [] and not mutants.blames(quiet, "shift")


def test_the_table_scores_killed_over_non_equivalent_and_lists_survivors(tmp_path, monkeypatch):
    rows = [{"id": "f:1:0:binop:a", "function": "f", "operator": "binop", "line": 1, "before": "a+b", "after": "a-b",
             "verdict": "killed", "named": True, "blamed": ["f"]},
            {"id": "f:2:0:number:2", "function": "f", "operator": "number", "line": 2, "before": "1", "after": "2",
             "verdict": "killed", "named": False, "blamed": []},
            {"id": "f:3:0:drop:x", "function": "f", "operator": "drop", "line": 3, "before": "x()", "after": "-",
             "verdict": "survived"},
            {"id": "f:4:0:double:y", "function": "f", "operator": "double", "line": 4, "before": "y()", "after": "y",
             "verdict": "survived"},
            {"id": "f:5:0:index:z", "function": "f", "operator": "index", "line": 5, "before": "z", "after": "z",
             "verdict": "stillborn"}]
    (tmp_path / "c.json").write_text(json.dumps({"checker": "c", "mutants": rows}))
    monkeypatch.setitem(mutants.EQUIVALENT, "f:4:0:double:y", "y() is idempotent")
    text, data = mutants.table(tmp_path)
    assert "| c | 4 | 2 | 1 | 1 | 1 | 67% |" in text
    assert data["c"]["equivalent"] == {"f:4:0:double:y": "y() is idempotent"}
    assert [s["id"] for s in data["c"]["survived"]] == ["f:3:0:drop:x"]
    assert "killed, but the report blamed no function: `f:2:0:number:2`" in text


def test_every_checker_gets_mutants_of_its_lessons_folded_solution():
    for name, checker in mutants._checkers().items():
        made = mutants.mutants(mutants.solution_source(checker))
        assert len(made) >= 8, (name, len(made))
        assert {m.function.split(".")[0] for m in made} & set(checker.names), name


def test_the_committed_table_covers_every_checker_at_90_percent_with_each_equivalent_argued():
    data = json.loads((ROOT / "tests" / "mutants.json").read_text())
    assert set(data) == set(mutants._checkers()), "regenerate with make mutants"
    for name, row in data.items():
        assert row["score"] >= 0.9, (name, row["survived"])
        assert all(why and len(why) > 20 for why in row["equivalent"].values()), name
        assert set(row["equivalent"]) <= set(mutants.EQUIVALENT), name
    assert "| checker | mutants | killed |" in (ROOT / "tests" / "mutants.md").read_text()
