"""Grade learners' notebooks without nbgrader's database: each runs headless, each exercise gets one verdict.

    python -m labkit.exercises grade alice/16_build_ddp_yourself.ipynb bob/16*.ipynb --csv grades.csv
    rows = grade(["alice.ipynb", "bob.ipynb"], cell_timeout=300)     # the same from Python: a list of Verdict

Each submission runs in a kernel of its own (nbclient) in grade mode (LABKIT_EXERCISES=grade: a checker cell raises
when its exercise is not written or fails), in a child process with a deadline, quick sizes (LABKIT_QUICK=1) and
its runs in a scratch folder. A cell past `cell_timeout` is interrupted and the notebook goes on; a submission past
`notebook_timeout` is stopped; either way every process it started (the kernel, its ranks, their workers: all
carry a tag in their environment) is killed before the next one starts, so a deadlock is a row that says so,
never a stuck grader. The checker cells are put back as the lesson wrote them where the lesson is found (nbgrader
locks them the same way), so a learner cannot edit a check away.

The learner is nbgrader's student id where the path says it (`submitted/<id>/<assignment>/x.ipynb`), else the
file's name. Each exercise's verdict: passed; failed, with the checker's first reason; not written; timed out; or
not run (the kernel died, the notebook was stopped first).
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .editions import find_exercises, lessons_dir
from ..rundir import RUNS_ENV
from .report import MODE_ENV

TAG_ENV = "LABKIT_GRADE_TAG"   # every process a graded notebook starts inherits it: how the grader finds them
SKIP_TAG = "labkit-grade-skip"  # cells after the last checker: nothing left to grade there
SETUP_KEY = "labkit_grade_setup"   # cells before the first exercise: imports, which a busy machine makes slow
SETUP_TIMEOUT = 120


@dataclass(frozen=True)
class Verdict:
    """One learner's one exercise."""

    learner: str
    notebook: str
    exercise: str
    status: str      # passed | failed | not written | timed out | not run
    reason: str
    seconds: float
    grade_id: str = ""   # nbgrader's id of the checker cell (its test cell)


def learner_of(path: Path) -> str:
    """nbgrader's student id (submitted/<id>/<assignment>/<file>) where the path has one, else the file's name."""
    parts = path.resolve().parts
    for folder in ("submitted", "autograded"):
        if folder in parts[:-3]:
            return parts[len(parts) - 1 - parts[::-1].index(folder) + 1]
    return path.stem


def _lesson_for(data: dict, path: Path) -> Path | None:
    stem = data.get("metadata", {}).get("labkit", {}).get("lesson") or path.stem
    for candidate in sorted(lessons_dir().glob("[0-9][0-9]_*.ipynb")):
        if candidate.stem == stem or stem.endswith(candidate.stem) or stem.startswith(candidate.stem):
            return candidate
    return None


def prepared(path: Path) -> tuple[dict, list, str]:
    """The submission as it will run: checker cells restored from the lesson where found, cells after the last
    checker tagged to be skipped. Returns (notebook JSON, its exercises, the lesson's name or the file's)."""
    data = json.loads(path.read_text())
    cells = data["cells"]
    exercises = find_exercises(cells)
    lesson = _lesson_for(data, path)
    if lesson is not None:
        original = json.loads(lesson.read_text())["cells"]
        theirs = find_exercises(original)
        if len(theirs) == len(exercises):
            for mine, ref in zip(exercises, theirs):
                for index, canonical in zip(mine.checkers, ref.checkers):
                    cells[index]["source"] = original[canonical]["source"]
            # the lesson's titles, even where a learner rewrote the ✏️ cell's first line
            exercises = [replace(mine, title=ref.title) for mine, ref in zip(exercises, theirs)]
    last = max((max(e.checkers) for e in exercises), default=-1)
    for cell in cells[:min((e.cell for e in exercises), default=0)]:
        cell.setdefault("metadata", {})[SETUP_KEY] = True
    for cell in cells[last + 1:]:
        cell.setdefault("metadata", {}).setdefault("tags", []).append(SKIP_TAG)
    return data, exercises, lesson.stem if lesson is not None else path.name


def _run_one(notebook: str, events: str, cell_timeout: float) -> None:
    """In the child process: execute `notebook`, writing each executed cell's outcome to `events` (JSON lines)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    out = open(events, "a", buffering=1)

    def executed(cell, cell_index, execute_reply) -> None:
        content = execute_reply.get("content", {}) if execute_reply else {}
        out.write(json.dumps({"cell": cell_index, "status": content.get("status", "unknown"),
                              "ename": content.get("ename", ""), "evalue": content.get("evalue", ""),
                              "time": time.time()}) + "\n")

    def started(cell, cell_index) -> None:
        out.write(json.dumps({"cell": cell_index, "start": time.time()}) + "\n")

    def timeout(cell) -> float:   # the lesson's setup (importing torch) gets what a busy machine needs
        return max(cell_timeout, SETUP_TIMEOUT) if cell.metadata.get(SETUP_KEY) else cell_timeout

    client = NotebookClient(nb, timeout=cell_timeout, timeout_func=timeout, allow_errors=True,
                            interrupt_on_timeout=True,
                            skip_cells_with_tag=SKIP_TAG, kernel_name="python3",
                            error_on_timeout={"ename": "Timeout", "evalue": f"past {cell_timeout:g} s"},
                            resources={"metadata": {"path": str(Path(notebook).parent)}},
                            on_cell_execute=started, on_cell_executed=executed)
    try:
        client.execute()
    except Exception as error:  # a dead kernel, a failed start: the parent names what did not run
        said = str(error).strip()
        name = type(error).__name__
        out.write(json.dumps({"crash": f"{name}: {said.splitlines()[0][:200]}" if said else name}) + "\n")


def kill_tagged(tag: str) -> int:
    """Kill every process whose environment carries TAG_ENV=tag (a graded notebook's kernel, ranks, workers)."""
    killed, mine = 0, os.getpid()
    needle = f"{TAG_ENV}={tag}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == mine:
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


def _verdicts(learner: str, notebook: str, exercises: list, events: list[dict], cell_timeout: float,
              stopped: str | None) -> list[Verdict]:
    done = {e["cell"]: e for e in events if "status" in e}
    starts = {e["cell"]: e["start"] for e in events if "start" in e}
    crash = next((e["crash"] for e in events if "crash" in e), None) or stopped
    rows = []
    for exercise, checker, n in ((e, c, n) for e in exercises for n, c in enumerate(e.checkers, 1)):
        record, status, reason = done.get(checker), "passed", ""
        took = record["time"] - starts.get(checker, record["time"]) if record else 0.0
        mine = done.get(exercise.cell, {})
        if mine.get("ename") == "Timeout":
            status, reason = "timed out", f"your ✏️ cell ran past {cell_timeout:g} s (a deadlock? a loop?)"
        elif record is None:
            status, reason = "not run", crash or "the notebook stopped before this checker"
        elif record["status"] == "ok":
            pass
        elif record["ename"] == "Timeout" or took >= cell_timeout * 0.98:
            status, reason = "timed out", f"the checker cell ran past {cell_timeout:g} s (a deadlock? a loop?)"
        elif record["ename"] == "ExerciseFailed":
            text = record["evalue"]
            first = text.splitlines()[0] if text else ""
            if first.endswith("NOT WRITTEN YET"):
                status, reason = "not written", ""
            else:
                status = "failed"
                reason = next((line.strip().removeprefix("✗ ") for line in text.splitlines()
                               if line.strip().startswith("✗")), first)
        elif mine.get("ename") == "NotImplementedError":
            status, reason = "not written", ""
        else:
            status = "failed"
            reason = f"{record['ename']}: {record['evalue'].strip().splitlines()[0] if record['evalue'] else ''}"
            if mine.get("status") == "error":
                reason = f"your cell raised {mine['ename']}: {mine['evalue'][:120]}; then {reason}"
        if stopped and status == "not run":
            reason = stopped
        title = exercise.title + (f" ({n})" if len(exercise.checkers) > 1 else "")
        grade_id = exercise.grade_id + "-check" + (str(n) if n > 1 else "")
        rows.append(Verdict(learner, notebook, title, status, reason[:300], round(took, 1), grade_id))
    return rows


def grade_one(path: str | Path, *, cell_timeout: float = 300, notebook_timeout: float = 1800,
              quick: bool = True) -> list[Verdict]:
    """Run one submission in grade mode and return one Verdict per exercise (see the module docstring)."""
    path = Path(path)
    learner = learner_of(path)
    try:
        data, exercises, notebook = prepared(path)
    except (OSError, ValueError, KeyError) as error:
        return [Verdict(learner, path.name, "(the notebook)", "not run", f"unreadable: {error}", 0.0)]
    if not exercises:
        return [Verdict(learner, path.name, "(the notebook)", "not run", "no ✏️ exercise in this notebook", 0.0)]
    tag = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as scratch:
        work = Path(scratch) / path.name
        work.write_text(json.dumps(data, ensure_ascii=False))
        events = Path(scratch) / "graded-cells.ndjson"
        env = dict(os.environ, **{MODE_ENV: "grade", TAG_ENV: tag, RUNS_ENV: str(Path(scratch) / "runs"),
                                  "MPLBACKEND": "Agg"})
        env.pop("NBGRADER_EXECUTION", None)
        if quick:
            env["LABKIT_QUICK"] = "1"
        # the notebook runs beside the submission, where the files it reads are, but its runs go to scratch
        code = ("import sys; from labkit.exercises.grading import _run_one; "
                "_run_one(sys.argv[1], sys.argv[2], float(sys.argv[3]))")
        child = subprocess.Popen([sys.executable, "-c", code, str(work), str(events), str(cell_timeout)],
                                 env=env, cwd=path.parent, start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stopped = None
        try:
            _, err = child.communicate(timeout=notebook_timeout)
            if child.returncode:
                stopped = f"the grader's child exited {child.returncode}: {err.decode()[-200:].strip()}"
        except subprocess.TimeoutExpired:
            stopped = f"the notebook was stopped after {notebook_timeout:g} s"
        finally:
            kill_tagged(tag)
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        lines = events.read_text().splitlines() if events.exists() else []
        if os.environ.get("LABKIT_GRADE_EVENTS"):   # for profiling a grader run: each cell's times
            Path(os.environ["LABKIT_GRADE_EVENTS"]).write_text("\n".join(lines))
        return _verdicts(learner, notebook, exercises, [json.loads(line) for line in lines if line.strip()],
                         cell_timeout, stopped)


def grade(submissions: list[str | Path], *, csv_path: str | Path | None = None, cell_timeout: float = 300,
          notebook_timeout: float = 1800, quick: bool = True, echo: bool = False) -> list[Verdict]:
    """Grade each submission in turn (grade_one); write every row to `csv_path` if given."""
    rows: list[Verdict] = []
    for submission in submissions:
        found = grade_one(submission, cell_timeout=cell_timeout, notebook_timeout=notebook_timeout, quick=quick)
        rows += found
        if echo:
            for row in found:
                print(f"  {row.learner}  {row.exercise}: {row.status}{' — ' + row.reason if row.reason else ''}",
                      flush=True)
        if csv_path is not None:   # after each submission: a grader stopped half way keeps what it graded
            write_csv(rows, csv_path)
    return rows


def write_csv(rows: list[Verdict], path: str | Path) -> Path:
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(Verdict.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    return path


def _short(text: str, width: int = 150) -> str:
    return text if len(text) <= width else text[:width - 1].rstrip() + "…"


MARKS = {"passed": "✓", "failed": "✗", "not written": "…", "timed out": "⏱", "not run": "—"}


def table(rows: list[Verdict]) -> str:
    """Learner × exercise, one mark each (✓ passed, ✗ failed, … not written, ⏱ timed out, — not run), then
    each failure's reason."""
    exercises = list(dict.fromkeys((r.notebook, r.exercise) for r in rows))
    learners = list(dict.fromkeys(r.learner for r in rows))
    cell = {(r.learner, r.notebook, r.exercise): r for r in rows}
    heads = [f"{i + 1}" for i in range(len(exercises))]
    width = max([len(name) for name in learners] + [7])
    lines = [f"{'learner':<{width}}  " + "  ".join(heads) + "  score"]
    for learner in learners:
        marks, score, graded = [], 0, 0
        for (notebook, exercise), head in zip(exercises, heads):
            row = cell.get((learner, notebook, exercise))
            marks.append(f"{MARKS[row.status] if row else ' ':<{len(head)}}")
            score += bool(row and row.status == "passed")
            graded += row is not None
        lines.append(f"{learner:<{width}}  " + "  ".join(marks) + f"  {score}/{graded}")
    lines += [f"  {head}: {notebook} · {exercise}" for head, (notebook, exercise) in zip(heads, exercises)]
    lines += [f"  {r.learner} · {r.exercise}: {r.status} — {_short(r.reason)}" for r in rows if r.reason]
    return "\n".join(lines)
