"""Mutation testing of the exercises' checkers: each lesson's folded solution, changed one small way at a time, run
through its checker on real ranks. A checker that tells the truth fails every mutant that is wrong, and its failing
line names the function that was changed.

    python tools/mutants.py list                          # the checkers and how many mutants each gets
    python tools/mutants.py run --out /tmp/mutants        # every checker (about 15-25 min on 2 cores)
    python tools/mutants.py run --checker zero --out /tmp/mutants --limit 10
    python tools/mutants.py table /tmp/mutants --write tests/mutants   # tests/mutants.md and .json

Not part of `make test` (it launches several hundred short jobs): `make mutants` runs it.

Why a mutator of our own, not mutmut or cosmic-ray: those mutate files of an installed package and judge a mutant by
a test command's exit status. Here the code under test is a solution folded in a notebook's markdown, the judge is
a checker's Report (not an exit status), and what is measured is also *which function the report blames*; both
tools would need the solutions written out as modules and a wrapper script per mutant. The operators are the usual
ones (theirs and the literature's), applied to the solution's AST:

    binop      + <-> -,  * <-> /,  // -> /
    compare    == <-> !=,  < <-> <=,  > <-> >=
    number     an integer constant n -> n + 1 and n - 1 (0 -> 1)
    index      x[i] -> x[i + 1] where i is a name
    boolop     and <-> or;  not x -> x
    reduceop   ReduceOp.SUM -> ReduceOp.MAX (and AVG -> SUM)
    peer       src= / dst= / group_src= / group_dst= value v -> v + 1
    async      async_op=True -> False
    drop       a statement that is a call, dropped (a wait(), a collective, an in-place division, an append...)
    double     a statement that is a call, made twice

A mutant that does not even define the solution's names (a syntax or name error at definition) is left out.
Survivors the checker cannot catch because they do not change what the code computes are "equivalent": each is
listed in EQUIVALENT below with the reason, by its id.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import io
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Checker:
    """One exercise: its lesson, the solution's names, and how its checker is called on them."""

    name: str
    lesson: str
    names: tuple[str, ...]
    call: Callable[..., Any]   # call(namespace, timeout) -> Report


def _checkers() -> dict[str, Checker]:
    from labkit import exercises as ex
    return {c.name: c for c in [
        Checker("ddp naive", "16_build_ddp_yourself.ipynb", ("MyNaiveDDP",),
                lambda ns, t: ex.check_ddp(ns["MyNaiveDDP"], timeout=t)),
        Checker("ddp overlap", "16_build_ddp_yourself.ipynb", ("MyOverlapDDP",),
                lambda ns, t: ex.check_ddp(ns["MyOverlapDDP"], overlap=True, timeout=t)),
        Checker("ddp buckets", "16_build_ddp_yourself.ipynb", ("MyBucketedDDP",),
                lambda ns, t: ex.check_ddp(ns["MyBucketedDDP"], bucket_size_mb=0.01, timeout=t)),
        Checker("zero", "17_build_zero_yourself.ipynb", ("MyShardedOptimizer",),
                lambda ns, t: ex.check_sharded_optimizer(ns["MyShardedOptimizer"], timeout=t)),
        Checker("pipeline", "18_pipeline_parallel.ipynb", ("my_1f1b",),
                lambda ns, t: ex.check_pipeline(ns["my_1f1b"], timeout=t)),
        Checker("a2a", "19_mixture_of_experts.ipynb", ("dispatch", "combine"),
                lambda ns, t: ex.check_a2a(ns["dispatch"], ns["combine"], timeout=t)),
        Checker("ring", "23_context_parallelism.ipynb", ("my_ring",),
                lambda ns, t: ex.check_ring(ns["my_ring"], timeout=t)),
        Checker("tp", "27_tensor_and_sequence_parallel.ipynb", ("MyColumnParallelLinear", "MyRowParallelLinear"),
                lambda ns, t: ex.check_tp(ns["MyColumnParallelLinear"], ns["MyRowParallelLinear"], timeout=t)),
    ]}


# Survivors that compute what the solution computes (id -> why), so that no checker could fail them.
_IDEMPOTENT = "the call, made twice, leaves what it made once: "
EQUIVALENT: dict[str, str] = {
    # tp, a2a
    "MyColumnParallelLinear.__init__:13:8:double:super().__init__(); super().__init__()":
        "nn.Module.__init__ run twice before anything is assigned: the second makes the same empty module",
    "MyRowParallelLinear.__init__:31:8:double:super().__init__(); super().__init__()":
        "nn.Module.__init__ run twice before anything is assigned: the second makes the same empty module",
    "dispatch:9:4:double:dist.all_to_all_single(recv, send); dist":
        "the counts' all_to_all_single run twice writes the same counts into recv again (same sizes on every rank)",
    "dispatch:12:4:double:dist.all_to_all_single(received, tokens[":
        "the rows' all_to_all_single run twice writes the same rows into received again",
    "combine:20:4:double:dist.all_to_all_single(back, processed, ":
        "the reverse all_to_all_single run twice writes the same rows into back again",
    # --- ddp buckets ---
    "MyBucketedDDP.__init__:8:8:double:super().__init__(); super().__init__()":
        "nn.Module.__init__ twice, before any attribute is set: the same empty module",
    "MyBucketedDDP.__init__:13:16:double:dist.broadcast(param, src=0); dist.broad":
        _IDEMPOTENT + "the second broadcast sends rank 0's values again, which every rank already holds",
    "MyBucketedDDP.send:37:8:double:torch.cat([p.grad.reshape(-1) for p in b":
        _IDEMPOTENT + "the same gradients copied into the same flat buffer, before its all-reduce starts",
    "MyBucketedDDP.finish_gradient_synchronization:44:12:double:bucket['handle'].wait(); bucket['handle'":
        _IDEMPOTENT + "waiting on a completed work returns at once",
    "MyBucketedDDP.finish_gradient_synchronization:47:16:double:param.grad.copy_(bucket['flat'][offset:o":
        _IDEMPOTENT + "the same slice copied into the same gradient",
    # --- ddp naive ---
    "MyNaiveDDP.__init__:8:8:double:super().__init__(); super().__init__()":
        "nn.Module.__init__ twice, before any attribute is set: the same empty module",
    "MyNaiveDDP.__init__:13:16:double:dist.broadcast(param, src=0); dist.broad":
        _IDEMPOTENT + "the second broadcast sends rank 0's values again, which every rank already holds",
    "MyNaiveDDP.finish_gradient_synchronization:23:15:boolop:param.requires_grad or param.grad is not":
        "differs from `and` only for a trained parameter without a gradient (unused in the step) or a frozen one "
        "with a gradient; CheckNet has neither, and adding an unused parameter would hang the lesson's bucketed "
        "solution, whose bucket would never fill",
    # --- ddp overlap ---
    "MyOverlapDDP.__init__:8:8:double:super().__init__(); super().__init__()":
        "nn.Module.__init__ twice, before any attribute is set: the same empty module",
    "MyOverlapDDP.__init__:14:16:double:dist.broadcast(param, src=0); dist.broad":
        _IDEMPOTENT + "the second broadcast sends rank 0's values again, which every rank already holds",
    "MyOverlapDDP.finish_gradient_synchronization:33:8:drop:(dropped)":
        "the handles list is not cleared: each later step waits on the earlier steps' completed works again, "
        "which returns at once (a leak of handles, not a wrong value)",
    "MyOverlapDDP.finish_gradient_synchronization:33:8:double:self.handles.clear(); self.handles.clear":
        _IDEMPOTENT + "clearing an empty list",
    "MyOverlapDDP.finish_gradient_synchronization:32:12:double:handle.wait(); handle.wait()":
        _IDEMPOTENT + "waiting on a completed work returns at once",
    # --- zero ---
    "MyShardedOptimizer.__init__:11:21:number:1":
        "every rank's load starts at 1 instead of 0: the least-loaded rank is the same at every choice",
    "MyShardedOptimizer.add_param_group:30:64:compare:k == 'params'":
        "the local group is built without the group's settings, but step() copies every setting of the group "
        "onto it before each local step, so they are in place whenever they are used",
    "MyShardedOptimizer.step:43:12:double:self.local.param_groups[inner].update(se":
        _IDEMPOTENT + "the same settings written twice",
    "MyShardedOptimizer.step:48:20:double:dist.broadcast(param, src=self.owner[id(":
        _IDEMPOTENT + "the owner sends the value every rank already holds",
    # ring, pipeline
    "my_ring:16:11:binop:acc[0] - 0 * kv.sum()": "the tie subtracts 0 * kv.sum() instead of adding it: the same output "
                                                 "and gradients (0 either way), and every shift still tied in",
    "my_ring:16:20:binop:0 / kv.sum()": "the tie adds 0 / kv.sum(): 0 (kv.sum() is never 0 for random K and V), and "
                                        "its gradient -0 / kv.sum()^2 is 0; every shift still tied in",
}


def solution_source(checker: Checker) -> str:
    """The folded solution(s) of the checker's lesson that define its names, joined."""
    from labkit.exercises import blanks
    cells = json.loads((NOTEBOOKS / checker.lesson).read_text())["cells"]
    parts = []
    for index in [i for i, cell in enumerate(cells) if blanks.is_exercise(cell)]:
        solution = blanks.solution_of(cells[blanks._checker_after(cells, index) + 1]) or ""
        tree = ast.parse(solution)
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if defined & set(checker.names):
            parts.append(solution)
    if not parts:
        raise SystemExit(f"{checker.lesson}: no folded solution defines {checker.names}")
    return "\n".join(parts)


# --- the mutants ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mutant:
    id: str          # "<function>:<line>:<col>:<operator>"
    function: str    # the (Class.)function it changes
    operator: str
    line: int
    before: str
    after: str
    source: str


_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
          ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
          ast.And: ast.Or, ast.Or: ast.And}
_PEERS = {"src", "dst", "group_src", "group_dst"}


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, ast.FunctionDef):
                    yield f"{node.name}.{child.name}", child


def _is_docstring(node: ast.AST, parent: ast.AST) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)
            and isinstance(node.value.value, str))


def _edits(func: ast.AST) -> Iterator[tuple[ast.AST, str, Callable[[ast.AST], Any]]]:
    """(node, operator, change) for every place in `func` an operator applies; `change(copy_of_node)` returns the
    replacement node (or a list of statements, or None to drop the statement)."""
    for node in ast.walk(func):
        if isinstance(node, ast.BinOp) and type(node.op) in _SWAPS:
            yield node, "binop", lambda n: ast.BinOp(n.left, _SWAPS[type(n.op)](), n.right)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _SWAPS:
            yield node, "compare", lambda n: ast.Compare(n.left, [_SWAPS[type(n.ops[0])]()], n.comparators)
        elif isinstance(node, ast.BoolOp):
            yield node, "boolop", lambda n: ast.BoolOp(_SWAPS[type(n.op)](), n.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "boolop", lambda n: n.operand
        elif (isinstance(node, ast.Constant) and type(node.value) is int and not isinstance(node.value, bool)
              and abs(node.value) < 1000):
            yield node, "number", lambda n: ast.Constant(n.value + 1)
            if node.value != 0:
                yield node, "number", lambda n: ast.Constant(n.value - 1)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name):
            yield node, "index", lambda n: ast.Subscript(n.value, ast.BinOp(n.slice, ast.Add(), ast.Constant(1)),
                                                         n.ctx)
        elif isinstance(node, ast.Attribute) and node.attr in ("SUM", "AVG") and "ReduceOp" in ast.unparse(node):
            yield node, "reduceop", lambda n: ast.Attribute(n.value, "MAX" if n.attr == "SUM" else "SUM", n.ctx)
        elif isinstance(node, ast.keyword) and node.arg in _PEERS:
            yield node, "peer", lambda n: ast.keyword(n.arg, ast.BinOp(n.value, ast.Add(), ast.Constant(1)))
        elif (isinstance(node, ast.keyword) and node.arg == "async_op" and isinstance(node.value, ast.Constant)
              and node.value.value is True):
            yield node, "async", lambda n: ast.keyword("async_op", ast.Constant(False))
    for node in ast.walk(func):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                    yield stmt, "drop", lambda n: None
                    yield stmt, "double", lambda n: [n, copy.deepcopy(n)]


def mutants(source: str) -> list[Mutant]:
    """Every single-change mutant of `source`'s functions and methods, in source order."""
    tree = ast.parse(source)
    out: list[Mutant] = []
    for fname, func in _functions(tree):
        for target, operator, change in _edits(func):
            if _is_docstring(target, func) and operator in ("drop", "double"):
                continue
            mutated_tree = copy.deepcopy(tree)
            twin = _find(mutated_tree, target)
            if twin is None:
                continue
            replacement = change(copy.deepcopy(twin))
            if not _replace(mutated_tree, twin, replacement):
                continue
            ast.fix_missing_locations(mutated_tree)
            try:
                after = ast.unparse(replacement) if isinstance(replacement, ast.AST) else \
                    ("(dropped)" if replacement is None else "; ".join(ast.unparse(r) for r in replacement))
                text = ast.unparse(mutated_tree)
            except Exception:   # noqa: BLE001 - an operator that made an invalid tree: no mutant
                continue
            line, col = getattr(target, "lineno", 0), getattr(target, "col_offset", 0)
            out.append(Mutant(f"{fname}:{line}:{col}:{operator}:{after[:40]}", fname, operator, line,
                              ast.unparse(target)[:80], after[:80], text))
    unique, seen = [], set()
    for m in out:
        if m.id not in seen and m.source != ast.unparse(tree):
            seen.add(m.id)
            unique.append(m)
    return unique


def _find(tree: ast.AST, target: ast.AST) -> ast.AST | None:
    key = (type(target), getattr(target, "lineno", None), getattr(target, "col_offset", None),
           getattr(target, "end_lineno", None), getattr(target, "end_col_offset", None), ast.dump(target))
    for node in ast.walk(tree):
        if (type(node), getattr(node, "lineno", None), getattr(node, "col_offset", None),
                getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None), ast.dump(node)) == key:
            return node
    return None


def _replace(tree: ast.AST, old: ast.AST, new: Any) -> bool:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if isinstance(value, list) and any(v is old for v in value):
                i = next(i for i, v in enumerate(value) if v is old)
                if new is None:
                    value[i:i + 1] = [ast.Pass()] if len(value) == 1 else []
                elif isinstance(new, list):
                    value[i:i + 1] = new
                else:
                    value[i] = new
                return True
            if value is old:
                if new is None or isinstance(new, list):
                    return False
                setattr(parent, field, new)
                return True
    return False


# --- running them --------------------------------------------------------------------------------------------------

def lesson_namespace() -> dict[str, Any]:
    """What the exercise lessons import before their ✏️ cells (as tests/test_exercises_notebooks.py sets up)."""
    import torch
    from labkit import exercises as ex
    return {"torch": torch, "dist": torch.distributed, "nn": torch.nn, "F": torch.nn.functional, "ex": ex}


def blames(report: Any, function: str) -> bool:
    """Whether the report's failures name the mutated function (Class.method or method; a pair's either name)."""
    short = function.split(".")[-1]
    return any(part == function or part.split(".")[-1] == short or short in part for part in report.blamed)


def run_one(checker: Checker, mutant: Mutant, timeout: float) -> dict[str, Any]:
    namespace = lesson_namespace()
    try:
        exec(compile(mutant.source, f"mutant {mutant.id}", "exec"), namespace)
    except Exception as error:   # noqa: BLE001 - stillborn: it does not define the solution
        return {"verdict": "stillborn", "why": f"{type(error).__name__}: {error}"[:200]}
    started = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            report = checker.call(namespace, timeout)
        except Exception as error:   # noqa: BLE001 - a checker that raises is itself a finding
            return {"verdict": "checker raised", "why": f"{type(error).__name__}: {error}"[:300],
                    "seconds": round(time.monotonic() - started, 1)}
    failed = [f for f in report.findings if f.status in ("fail", "missing")]
    return {"verdict": "killed" if not report.ok else "survived", "seconds": round(time.monotonic() - started, 1),
            "named": blames(report, mutant.function) if not report.ok else None,
            "blamed": report.blamed, "first_failure": failed[0].line()[:240] if failed else ""}


def run(names: list[str], out: Path, limit: int | None, timeout: float) -> None:
    checkers = _checkers()
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        checker = checkers[name]
        made = mutants(solution_source(checker))[:limit]
        rows = []
        print(f"{name}: {len(made)} mutants", flush=True)
        for i, mutant in enumerate(made):
            got = run_one(checker, mutant, timeout)
            rows.append({**{k: v for k, v in asdict(mutant).items() if k != "source"}, **got})
            print(f"  {i + 1}/{len(made)} {got['verdict']:9} {mutant.id}  {got.get('first_failure', '')[:100]}",
                  flush=True)
        (out / f"{name.replace(' ', '_')}.json").write_text(json.dumps({"checker": name, "mutants": rows}, indent=1))


def table(folder: Path) -> tuple[str, dict[str, Any]]:
    """The markdown table (one row per checker) and the data behind it, from a folder of `run` results."""
    results = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    if not results:
        raise SystemExit(f"{folder}: no results; run `python tools/mutants.py run --out {folder}` first")
    lines = ["| checker | mutants | killed | named the function | survived | equivalent | score |",
             "|---|---|---|---|---|---|---|"]
    data = {}
    for result in results:
        rows = [r for r in result["mutants"] if r["verdict"] != "stillborn"]
        killed = [r for r in rows if r["verdict"] == "killed"]
        named = [r for r in killed if r["named"]]
        equivalent = [r for r in rows if r["verdict"] == "survived" and r["id"] in EQUIVALENT]
        survived = [r for r in rows if r["verdict"] in ("survived", "checker raised") and r["id"] not in EQUIVALENT]
        score = len(killed) / max(1, len(rows) - len(equivalent))
        lines.append(f"| {result['checker']} | {len(rows)} | {len(killed)} | {len(named)} | {len(survived)} | "
                     f"{len(equivalent)} | {score:.0%} |")
        data[result["checker"]] = {"mutants": len(rows), "killed": len(killed), "named": len(named),
                                   "survived": [{"id": r["id"], "before": r["before"], "after": r["after"]}
                                                for r in survived],
                                   "equivalent": {r["id"]: EQUIVALENT[r["id"]] for r in equivalent},
                                   "unnamed": [{"id": r["id"], "blamed": r["blamed"]} for r in killed
                                               if not r["named"]],
                                   "score": round(score, 3)}
    text = ["# Mutation testing of the exercises' checkers", "",
            "Generated by `python tools/mutants.py table <results> --write tests/mutants` from a run of "
            "`python tools/mutants.py run`. Each lesson's folded solution is changed in one small place (see the "
            "tool's operators) and run through its checker on real ranks: *killed* means the report failed, "
            "*named* that its failing line named the changed function, *equivalent* survivors compute what the "
            "solution computes (the tool's EQUIVALENT says why), and the score is killed / (mutants - "
            "equivalent).", ""] + lines + [""]
    for name, d in data.items():
        if d["survived"] or d["unnamed"]:
            text.append(f"## {name}")
            text += [f"- survived: `{s['id']}` (`{s['before']}` -> `{s['after']}`)" for s in d["survived"]]
            text += [f"- killed, but the report blamed {u['blamed'] or 'no function'}: `{u['id']}`"
                     for u in d["unnamed"]]
            text.append("")
    return "\n".join(text), data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list")
    r = sub.add_parser("run")
    r.add_argument("--checker", action="append", help="a checker's name (default: all); repeat for more")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--limit", type=int, default=None, help="at most this many mutants per checker")
    r.add_argument("--timeout", type=float, default=12.0, help="seconds without progress before a hang is called")
    t = sub.add_parser("table")
    t.add_argument("folder", type=Path)
    t.add_argument("--write", type=Path, help="write <path>.md and <path>.json")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, checker in _checkers().items():
            print(f"{name:12} {len(mutants(solution_source(checker))):4} mutants  ({checker.lesson})")
        return 0
    if args.command == "run":
        known = list(_checkers())
        wrong = [c for c in args.checker or [] if c not in known]
        if wrong:
            print(f"unknown checker(s) {wrong}: one of {known}", file=sys.stderr)
            return 2
        run(args.checker or known, args.out, args.limit, args.timeout)
        return 0
    text, data = table(args.folder)
    print(text)
    if args.write:
        args.write.with_suffix(".md").write_text(text)
        args.write.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
