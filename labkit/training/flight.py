"""torch's Flight Recorder, read from inside a rank: the one module that touches its private API.

    from labkit.training import flight
    flight.problem()                 # None, or why this torch cannot be read (the private API moved)
    flight.entries()                 # this process's recorded collectives, oldest first (no stacks)
    flight.last_seq(entries)         # the newest collective's sequence number in the default group, -1: none yet
    flight.dump(path)                # every entry with the Python frames that issued it, as JSON (os.replace'd)

The recorder is on by default in torch 2.13 for gloo and NCCL (TORCH_FR_BUFFER_SIZE entries, 2000): sequence id,
op, sizes, the time it was created (time_created_ns) and the stack down to the user's line. Reading it costs about
0.3 ms on a CPU rank, so an agent may read it every fraction of a second. It is a private API
(torch._C._distributed_c10d._dump_fr_trace): labkit's tests call it on the declared torch range, and where it is
missing problem() says so and the callers carry on without collectives.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

KEEP = ("collective_seq_id", "profiling_name", "input_sizes", "input_dtypes", "retired", "process_group",
        "is_p2p", "time_created_ns", "state")


def problem() -> str | None:
    """Why the Flight Recorder cannot be read in this torch, or None when it can."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError as exc:  # a torch built without distributed
        return f"torch.distributed is not available ({exc})"
    if not hasattr(c10d, "_dump_fr_trace"):
        return "this torch has no torch._C._distributed_c10d._dump_fr_trace (the Flight Recorder's reader moved)"
    return None


def _raw(stacks: bool) -> dict[str, Any]:
    import torch._C._distributed_c10d as c10d
    return pickle.loads(c10d._dump_fr_trace(includeStackTraces=stacks))  # made by this very process: trusted


def entries(stacks: bool = False) -> list[dict[str, Any]]:
    """This process's recorded collectives, oldest first; [] where the recorder cannot be read."""
    if problem():
        return []
    out = []
    for e in _raw(stacks).get("entries", []):
        entry = {k: e.get(k) for k in KEEP}
        if stacks:
            entry["frames"] = [[f["filename"], f["line"], f["name"]] for f in e.get("frames", [])]
        out.append(entry)
    return out


def group_of(entry: dict[str, Any]) -> str:
    """The process group's name ('0' is the default group)."""
    group = entry.get("process_group") or ("", "")
    return str(group[0])


def last_seq(found: list[dict[str, Any]], group: str = "0") -> int:
    """The newest collective's sequence number in `group` (default: the default group); -1 when there is none."""
    seqs = [e["collective_seq_id"] for e in found if not e.get("is_p2p") and group_of(e) == group]
    return max(seqs, default=-1)


def dump(path: str | Path) -> None:
    """Every recorded collective with its frames, to `path` as JSON ({"entries": [...]}); written whole, then moved
    into place, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"entries": entries(stacks=True), "problem": problem()}, default=list))
    os.replace(tmp, path)
