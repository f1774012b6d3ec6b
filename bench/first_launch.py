"""The first minute of a notebook, in fresh Jupyter kernels, side by side: the first cell, and the import cell plus
the first launch of lesson 00's job, for labkit and for a plain fork doing the same work (and torch's spawn,
accelerate's notebook_launcher); and a launch after CUDA was (faked as) initialised, labkit's warm process against
a spawn. Every sample is a new kernel, as a learner opening a lesson.

    .venv/bin/python bench/first_launch.py              # 3 kernels per kind: ~4 min idle, more on 2 busy cores
    .venv/bin/python bench/first_launch.py --samples 2 --pause 3 --kinds labkit,"plain fork"

In each kernel, like a learner's first cells: cell 1 is the first import alone, timed (`import labkit`, which in a
kernel also starts labkit's warm process; `import torch` for the others); cell 2 the launcher's other imports,
timed; cell 3 waits --pause seconds (reading the text); cell 4 launches lesson 00's job on 2 ranks and times the
call to the end of rank 0's first optimizer step; cell 5 launches again (a later launch, for contrast). The job is
the same for all: DDP over transformers' tiny GPT-2, one AdamW step (labkit: launch(RunConfig(world_size=2,
steps=3)), lesson 00's first launch; the others: bench/launch_workers.py). "after CUDA" kernels fake CUDA as
initialised (as tests/test_gpu_logic.py does) before launching, with labkit's default (the warm process) or
start_method="spawn". The kinds take turns across kernels (a rotated order per sample) so that other jobs on the
machine hit all alike; medians over samples are reported, and the ratios with their goals (bench/all.py's table).

accelerate (the `bench` extra: pip install -c requirements.lock -e ".[bench]") is optional: without it, its
row is left out and said so.
"""
from __future__ import annotations

import argparse
import json
import re
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
LESSON_00 = "labkit.launch(labkit.RunConfig(world_size=2, steps=3))"

PLAIN_FORK = """_port = w.free_port()
_procs = [mp.get_context("fork").Process(target=w.plain_rank, args=(r, 2, _port)) for r in range(2)]
for _p in _procs: _p.start()
for _p in _procs: _p.join()"""

FAKE_CUDA = """import traceback
import labkit.run.cuda_guard as _guard
_guard.cuda_is_initialised = lambda: True      # as if a cell had put a tensor on the GPU
_guard._cuda_initialised_before_labkit = False
_guard._cuda_init_stack = [traceback.FrameSummary("a cell", 1, "torch.zeros(1, device='cuda')")]"""

LESSON_00_FIRST_CELL = """import torch
import pandas as pd
import labkit
from labkit import RunConfig, Fault, launch, compare, pick"""

# kind -> (cell 1: the first import, cell 2: the other imports, the launch itself or None)
KINDS = {
    "labkit": ("import labkit", "", "_r = " + LESSON_00),
    "plain fork": ("import torch", "import multiprocessing as mp\nimport launch_workers as w", PLAIN_FORK),
    "mp.spawn": ("import torch", "import torch.multiprocessing as tmp\nimport launch_workers as w",
                 "tmp.spawn(w.plain_rank, args=(2, w.free_port()), nprocs=2)"),
    "notebook_launcher": ("import torch", "from accelerate import notebook_launcher\nimport launch_workers as w",
                          "notebook_launcher(w.accelerate_rank, num_processes=2, use_port=str(w.free_port()))"),
    "labkit after CUDA": ("import labkit", FAKE_CUDA, "_r = " + LESSON_00),
    "spawn after CUDA": ("import labkit", FAKE_CUDA, "_r = " + LESSON_00[:-1] + ', start_method="spawn")'),
    "lesson 00's first cell": (LESSON_00_FIRST_CELL, "", None),
}

TIMED_CELL = """_t = time.perf_counter()
{code}
_timed.append(time.perf_counter() - _t)"""

LAUNCH_CELL = """_out = os.path.join({scratch!r}, "first-step-{n}")
os.environ["FIRST_STEP_OUT"] = _out
_t0 = time.time()
_r = None
{launch}
_end = float(open(_out).read()) if os.path.exists(_out) else float(_r.df[_r.df["rank"] == 0]["time"].min())
_launches.append(_end - _t0)"""


@dataclass
class Sample:
    kind: str
    first_cell_s: float    # cell 1: the first import alone
    import_s: float        # cells 1 and 2: every import the launch needs
    first_s: float         # cell 4: the call -> rank 0's first step ended (nan: no launch)
    later_s: float         # cell 5, the same in the same kernel


def run_kernel(kind: str, pause: float, scratch: Path) -> Sample:
    """One fresh kernel: imports (timed), pause, launch twice; the timings it printed."""
    from jupyter_client import KernelManager
    first, more, launch = KINDS[kind]
    cells = [f"import time, os, sys, json\nsys.path.insert(0, {str(BENCH)!r})\n_timed, _launches = [], []",
             TIMED_CELL.format(code=first), TIMED_CELL.format(code=more or "pass"), f"time.sleep({pause})"]
    if launch is not None:
        cells += [LAUNCH_CELL.format(scratch=str(scratch), n=n, launch=launch) for n in (1, 2)]
    cells.append('print("RESULT " + json.dumps({"timed": _timed, "launches": _launches}))')
    env = {**os.environ, "LABKIT_RUNS": str(scratch / "runs"), "TMPDIR": str(scratch), "MPLBACKEND": "Agg"}
    env.pop("LABKIT_PREWARM", None)  # the kernel decides, as in a learner's notebook
    km = KernelManager(kernel_name="python3")
    kernel_log = open(scratch / "kernel.log", "w")  # the ranks' own output lands here too (fork, spawn)
    km.start_kernel(env=env, cwd=str(scratch), stdout=kernel_log, stderr=subprocess.STDOUT)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        printed: list[str] = []

        def keep(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                printed.append("\n".join(msg["content"]["traceback"]))
        for cell in cells:
            reply = kc.execute_interactive(cell, timeout=600, output_hook=keep)
            if reply["content"]["status"] != "ok":
                kernel_log.flush()
                raise RuntimeError(f"{kind}: a cell failed:\n{cell}\n{''.join(printed)[-1500:]}\n"
                                   f"kernel and ranks said:\n{(scratch / 'kernel.log').read_text()[-3000:]}")
        line = next(l for l in "".join(printed).splitlines() if l.startswith("RESULT "))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        kernel_log.close()
    out = json.loads(line[len("RESULT "):])
    first_s, later_s = out["launches"] if out["launches"] else (float("nan"), float("nan"))
    return Sample(kind, out["timed"][0], sum(out["timed"]), first_s, later_s)


def available(kinds: list[str]) -> tuple[list[str], list[str]]:
    """The kinds that can run here, and those left out (accelerate is an optional extra)."""
    import importlib.util
    no_accelerate = importlib.util.find_spec("accelerate") is None
    missing = [name for name in kinds if name == "notebook_launcher" and no_accelerate]
    return [name for name in kinds if name not in missing], missing


def measure(samples: int, pause: float, kinds: list[str] | None = None) -> dict[str, list[Sample]]:
    """`samples` fresh kernels per kind, the kinds in a rotated order each round."""
    names, _ = available(kinds or list(KINDS))
    out: dict[str, list[Sample]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="labkit-first-launch-") as scratch:
        for i in range(samples):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                folder = Path(scratch) / f"{re.sub(r'[^A-Za-z0-9]+', '-', name)}-{i}"
                out[name].append(sample_once_more_if_it_fails(name, pause, folder))
    return out


FAILED_SAMPLES: list[str] = []  # launches that failed and were run again in a fresh kernel (reported)


def sample_once_more_if_it_fails(name: str, pause: float, folder: Path) -> Sample:
    """One kernel's sample; a failed launch (seen once here with spawn: a rank died of SIGABRT) is reported and
    run once more in a fresh kernel. A second failure ends the benchmark."""
    try:
        folder.mkdir()
        return run_kernel(name, pause, folder)
    except RuntimeError as exc:
        FAILED_SAMPLES.append(f"{name}: {str(exc)[-2000:]}")
        print(f"\n{name}: a launch failed; running this sample again in a fresh kernel:\n{str(exc)[-2000:]}")
        retry = folder.with_name(folder.name + "-again")
        retry.mkdir()
        return run_kernel(name, pause, retry)


def medians(samples: list[Sample]) -> dict[str, float]:
    return {k: statistics.median(getattr(s, k) for s in samples)
            for k in ("first_cell_s", "import_s", "first_s", "later_s")}


def rows(results: dict[str, list[Sample]]) -> list[tuple[str, float, float, float, str]]:
    """(what, labkit's seconds, the other's seconds, ratio, goal) for the summary table (bench/all.py); medians over
    fresh kernels. A launch is timed from the call to the end of rank 0's first optimizer step."""
    m = {name: medians(s) for name, s in results.items()}
    out = []
    if "labkit" in m and "plain fork" in m:
        lab, plain = m["labkit"], m["plain fork"]
        out.append(("first cell (s): import labkit / import torch", lab["first_cell_s"], plain["first_cell_s"],
                    "<= 1.5"))
        for other in ("plain fork", "mp.spawn", "notebook_launcher"):
            if other in m:
                out.append((f"import cell + 1st launch of lesson 00's job (s): labkit / {other}",
                            lab["import_s"] + lab["first_s"], m[other]["import_s"] + m[other]["first_s"], "<= 1"))
        out.append(("  of which the 1st launch (s): labkit / plain fork", lab["first_s"], plain["first_s"], ""))
        out.append(("  a 2nd launch in the same kernel (s): labkit / plain fork", lab["later_s"], plain["later_s"],
                    ""))
    if "labkit after CUDA" in m and "spawn after CUDA" in m:
        warm, spawn = m["labkit after CUDA"], m["spawn after CUDA"]
        out.append(("after CUDA (faked): 1st launch (s): warm process / spawn", warm["first_s"], spawn["first_s"],
                    "<= 1"))
        out.append(("after CUDA (faked): 2nd launch (s): warm process / spawn", warm["later_s"], spawn["later_s"],
                    "<= 0.5"))
    if "lesson 00's first cell" in m and "plain fork" in m:
        out.append(("lesson 00's first cell (torch, pandas, labkit) (s) / import torch",
                    m["lesson 00's first cell"]["first_cell_s"], m["plain fork"]["first_cell_s"], ""))
    return [(what, ours, theirs, ours / theirs, goal) for what, ours, theirs, goal in out]


def report(results: dict[str, list[Sample]], pause: float) -> None:
    print(f"\nfresh kernel per sample; 2 ranks; seconds, median of {len(next(iter(results.values())))} kernels "
          f"(min-max)\n  {'kind':<24}{'1st cell':>10}{'imports':>10}{'1st launch':>20}{'2nd launch':>20}")
    for name, samples in results.items():
        med = medians(samples)
        spread = {k: (min(getattr(s, k) for s in samples), max(getattr(s, k) for s in samples))
                  for k in ("first_s", "later_s")}
        print(f"  {name:<24}{med['first_cell_s']:>10.2f}{med['import_s']:>10.2f}"
              + "".join(f"{med[k]:>8.2f} ({lo:.2f}-{hi:.2f})" for k, (lo, hi) in spread.items()))
    if FAILED_SAMPLES:
        print(f"  {len(FAILED_SAMPLES)} launch(es) failed and were run again: "
              + "; ".join(f.splitlines()[0] for f in FAILED_SAMPLES))
    print(f"\n  {'ratio (the kernel pauses ' + format(pause, 'g') + ' s after its imports)':<72}{'labkit':>8}"
          f"{'other':>8}{'ratio':>8}  goal")
    for what, ours, theirs, ratio, goal in rows(results):
        print(f"  {what:<72}{ours:>8.2f}{theirs:>8.2f}{ratio:>8.2f}  {goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3, help="fresh kernels per kind")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between the import cells and the launch")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, from: " + ", ".join(KINDS))
    args = parser.parse_args()
    names, missing = available(args.kinds.split(","))
    if missing:
        print(f"left out (not installed): {missing}; pip install -c requirements.lock -e '.[bench]'")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    started = time.perf_counter()
    results = measure(args.samples, args.pause, names)
    report(results, args.pause)
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average after: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
