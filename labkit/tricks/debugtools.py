"""What the debugging tools add to a hang report: the flight recorder, DETAIL's fingerprints, a py-spy dump.

    from labkit.tricks import debugtools, hangs
    out = hangs.reproduce("order", debug=hangs.Debug(flight_recorder=True))
    records = debugtools.flight_records(out.run)    # every rank's recorded collectives: seq, op, sizes, line, done
    debugtools.first_divergence(records)            # the first collective the ranks disagree on, and the odd rank
    out = hangs.reproduce("shape", debug=hangs.Debug(level="DETAIL"))
    debugtools.fingerprints(out.failure)            # each rank's collective when DETAIL's check stopped them
    with debugtools.SpyOnHang(after_s=1.5) as spy:  # py-spy dumps every rank once their records stop moving
        hangs.reproduce("loop")
    print(debugtools.trimmed(spy.dumps[1]))         # rank 1's stack, as py-spy saw it from outside
    debugtools.collectives_figure({"order": records})   # ranks as rows, their collectives in order, where each stopped

The flight recorder (torch's ring buffer of recent collectives, TORCH_FR_BUFFER_SIZE entries) records on gloo in
torch 2.13 too: sequence number, op, tensor sizes and the Python stack of the call; on NCCL it adds start and
completion times. Ranks dump it themselves (hangs.Debug(flight_recorder=True)); a rank that died cannot.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from matplotlib.figure import Figure

from ..records import Run
from ..view import COLORS, new_figure, shown
from ..rundir import RunDir, rank_of, runs_root as resolve_runs_root

_TORCH_DIR = str(Path(torch.__file__).parent)
_AGENT_FILE = str(Path(__file__).parents[1] / "training" / "agent.py")  # `labkit watch` wraps backward() there
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?"
                          r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\])?(?:, TensorDtypes=(\w+))?")


def dump_flight_recorder(path: Path) -> None:
    """Write this process's flight recorder (every process group) to `path` as JSON; called inside a rank."""
    from ..training import flight
    flight.dump(path)


def flight_records(run: Run | str | Path) -> pd.DataFrame:
    """Every dumped collective of every rank (runs/<id>/rank<r>.fr.json): rank, group, seq, op, sizes, dtypes,
    done (completed and retired), line (the call outside torch that issued it)."""
    path = run.path if isinstance(run, Run) else Path(run)
    rows = []
    for file in RunDir(path).flight_records():
        rank = int(file.name[4:].split(".")[0])
        for e in json.loads(file.read_text())["entries"]:
            if e["is_p2p"]:
                continue
            rows.append({"rank": rank, "group": e["process_group"][1], "seq": e["collective_seq_id"],
                         "op": e["profiling_name"].split(":")[-1], "sizes": str(e["input_sizes"]),
                         "dtypes": ",".join(e["input_dtypes"]), "done": bool(e["retired"]),
                         "line": _caller(e["frames"])})
    columns = ["rank", "group", "seq", "op", "sizes", "dtypes", "done", "line"]
    return pd.DataFrame(rows, columns=columns).sort_values(["group", "seq", "rank"], ignore_index=True)


@dataclass
class Divergence:
    """The first collective (seq in group) on which the ranks disagree: what each rank issued there, and the
    odd ranks (the smallest group, when one group is smallest)."""

    group: str
    seq: int
    places: pd.DataFrame
    odd: list[int]


def first_divergence(records: pd.DataFrame, group: str | None = None) -> Divergence | None:
    """Walk the collectives in order; return the first where the ranks issued different ops or sizes, or where
    some rank issued nothing; None when all dumped ranks agree on everything they recorded."""
    if records.empty:
        return None
    group = group or records["group"].value_counts().index[0]
    mine = records[records["group"] == group]
    ranks = sorted(records["rank"].unique())
    for seq in sorted(mine["seq"].unique()):
        at = mine[mine["seq"] == seq].set_index("rank")
        places = pd.DataFrame([{"rank": r, **(at.loc[r, ["op", "sizes", "line", "done"]].to_dict() if r in at.index
                                               else {"op": "(not issued)", "sizes": "", "line": "", "done": False})}
                               for r in ranks])
        keys = [(row.op, row.sizes) for row in places.itertuples()]
        if len(set(keys)) > 1:
            return Divergence(group, int(seq), places, odd_ranks(dict(zip(ranks, keys))))
    return None


def fingerprints(failure: Any) -> pd.DataFrame:
    """What TORCH_DISTRIBUTED_DEBUG=DETAIL's check said each rank was running when it stopped them: rank, seq, op,
    shape, dtype (from each rank's "Detected mismatch between collectives" error)."""
    rows = []
    for status in failure.statuses:
        for rank, seq, op, shape, dtype in _FINGERPRINT.findall(status.detail + "\n" + status.traceback):
            if int(rank) == status.rank:  # each message shows its own rank first, then a peer that differs
                rows.append({"rank": status.rank, "seq": int(seq), "op": op, "shape": f"[{shape}]", "dtype": dtype})
                break
    return pd.DataFrame(rows, columns=["rank", "seq", "op", "shape", "dtype"])


def odd_ranks(keys: dict[int, Any]) -> list[int]:
    """The ranks whose key is the rarest, when one key is strictly rarer than every other; else []."""
    counts = Counter(keys.values())
    if len(counts) < 2:
        return []
    rarest = sorted(counts.values())
    return [] if rarest[0] == rarest[1] else sorted(r for r, k in keys.items() if counts[k] == rarest[0])


# --- py-spy: a stack dump taken from outside the process -------------------------------------------------------

def py_spy() -> str | None:
    """The py-spy executable (next to this Python, or on PATH), or None when it is not installed."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class SpyOnHang:
    """Runs `py-spy dump` on the ranks of the next launch once none has recorded anything for after_s seconds.

    dumps: {rank: text}; problem: why nothing was dumped (py-spy missing, ptrace not permitted, no hang)."""

    def __init__(self, after_s: float = 1.5, *, native: bool = False, runs_root: str | Path | None = None):
        self.after_s, self.native = after_s, native
        self.root = resolve_runs_root(runs_root)
        self.dumps: dict[int, str] = {}
        self.problem = "" if py_spy() else "py-spy is not installed (pip install py-spy)"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="labkit-py-spy", daemon=True)

    def __enter__(self) -> "SpyOnHang":
        # runs already here are not the next launch's, however recently written (a run that just ended in the
        # cell before still has its pid files: dumping those would read processes that are gone)
        self._before = set(self.root.glob("*"))
        if not self.problem:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        if not self.dumps and not self.problem:
            self.problem = "no rank stalled long enough to be dumped"

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            pids = self._pids()
            if pids and all(time.time() - _last_sign(self._run, r) > self.after_s for r in pids):
                for rank, pid in sorted(pids.items()):
                    self._dump(rank, pid)
                return

    def _pids(self) -> dict[int, int]:
        runs = [d for d in self.root.glob("*") if d.is_dir() and d not in self._before]
        for run in sorted(runs, key=lambda d: d.stat().st_mtime, reverse=True):
            files = RunDir(run).pidfiles()
            if files:
                self._run = run
                return {rank_of(f): int(f.read_text() or 0) for f in files}
        return {}

    def _dump(self, rank: int, pid: int) -> None:
        command = [py_spy(), "dump", "--pid", str(pid)] + (["--native"] if self.native else [])
        done = subprocess.run(command, capture_output=True, text=True, timeout=20,
                              env={**os.environ, "NO_COLOR": "1"})
        if done.returncode == 0:
            self.dumps[rank] = _ANSI.sub("", done.stdout)  # some terminals' settings colour it even into a pipe
        else:
            self.problem = f"py-spy could not read rank {rank} (pid {pid}): {(done.stderr or done.stdout).strip()}"


def trimmed(dump: str, width: int = 110) -> str:
    """A py-spy dump made readable: the main thread only, down to labkit's rank entry point, lines cut to width."""
    out = []
    for line in dump.splitlines():
        if line.startswith("Thread ") and out and any(o.startswith("Thread ") for o in out):
            break  # the next thread: the main thread comes first
        out.append(line if len(line) <= width else line[:width - 3] + "...")
        if "rank_main (" in line:
            break
    return "\n".join(out)


def _last_sign(run: Path, rank: int) -> float:
    """When rank last wrote anything labkit can see from outside: its records, else its pid file."""
    times = [p.stat().st_mtime for p in (RunDir(run).records(rank), RunDir(run).pidfile(rank)) if p.exists()]
    return max(times, default=time.time())


def _caller(frames: list[list[Any]]) -> str:
    for filename, line, name in frames:
        if not str(filename).startswith(_TORCH_DIR) and str(filename) != _AGENT_FILE:
            return f"{Path(filename).name}:{line} in {name}"
    return ""


@shown
def collectives_figure(records_by_kind: dict[str, pd.DataFrame], last: int = 6, title: str | None = None) -> Figure:
    """One panel per hang: each rank a row, its collectives in order (the flight recorder's sequence numbers,
    the last `last` up to the first disagreement), coloured by op; a hatched box is a collective the rank issued
    and still waits in; where a rank issued nothing that its peers did, it stopped in its own code (a cross).
    The odd ranks (first_divergence) have their row labels in red."""
    panels = [(kind, r) for kind, r in records_by_kind.items() if not r.empty]
    fig = new_figure(figsize=(4.6 * max(len(panels), 1), 0.9 + 0.55 * max(r["rank"].nunique() for _, r in panels)))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    ops = sorted({op for _, r in panels for op in r["op"]})
    color = {op: COLORS[i % len(COLORS)] for i, op in enumerate(ops)}
    for ax, (kind, records) in zip(axes, panels):
        divergence = first_divergence(records)
        group = divergence.group if divergence else records["group"].value_counts().index[0]
        mine = records[records["group"] == group]
        end = int(divergence.seq) if divergence else int(mine["seq"].max())
        ranks = sorted(records["rank"].unique())
        shown_seqs = [s for s in sorted(mine["seq"].unique()) if end - last < s <= end]
        for row, rank in enumerate(ranks):
            own = mine[(mine["rank"] == rank)].set_index("seq")
            for x, seq in enumerate(shown_seqs):
                if seq not in own.index:
                    if seq == end:  # its peers issued this one; it never did
                        ax.plot(x, row, "x", color="black", markersize=14, markeredgewidth=2.5)
                    continue
                entry = own.loc[seq]
                waiting = not bool(entry["done"])
                ax.add_patch(_box(x, row, color[entry["op"]], hatch="///" if waiting else None,
                                  edge="black" if waiting else "white"))
                ax.text(x, row, entry["op"].replace("all", "all\n") if len(entry["op"]) > 8 else entry["op"],
                        ha="center", va="center", fontsize=7)
        odd = set(divergence.odd) if divergence else set()
        ax.set(xlim=(-0.6, len(shown_seqs) - 0.4), ylim=(len(ranks) - 0.4, -0.6), title=kind, xlabel="collective #")
        ax.set_xticks(range(len(shown_seqs)), [str(s) for s in shown_seqs])
        ax.set_yticks(range(len(ranks)), [f"rank {r}" + ("  (odd one out)" if r in odd else "") for r in ranks])
        for label, rank in zip(ax.get_yticklabels(), ranks):
            label.set_color("red" if rank in odd else "black")
        ax.tick_params(length=0)
    fig.suptitle(title or "each rank's collectives in order (flight recorder); hatched: still waiting in it; "
                 "x: never issued (stuck in its own code)", fontsize=9)
    return fig


def _box(x: float, y: float, color: str, hatch: str | None, edge: str) -> Any:
    from matplotlib.patches import FancyBboxPatch
    return FancyBboxPatch((x - 0.42, y - 0.32), 0.84, 0.64, boxstyle="round,pad=0.02", facecolor=color, alpha=0.55,
                          hatch=hatch, edgecolor=edge, linewidth=1.2)
