"""The first launch in a fresh notebook kernel, side by side: labkit, a plain fork, torch's spawn, accelerate's
notebook_launcher. Every sample is a new Jupyter kernel, as a learner opening lesson 00.

    .venv/bin/python bench/first_launch.py              # 3 kernels per launcher: ~2 min idle, ~7 min on 2 busy cores
    .venv/bin/python bench/first_launch.py --samples 2 --pause 3

In each kernel, like a learner's first cells: cell 1 imports torch and the launcher (labkit: `import labkit`, which
in a kernel also imports torch._dynamo and transformers' GPT-2, see labkit/run/prewarm.py); cell 2 waits --pause
seconds (reading the text); cell 3 launches 2 ranks of the same tiny DDP job (bench/launch_workers.py) and times
the call to the end of rank 0's first optimizer step; cell 4 launches again (a later launch, for contrast). The
launchers take turns across kernels (a rotated order per sample) so that other jobs on the machine hit all alike.
Medians over samples are reported, and the ratios that the issue asks about: labkit's first launch against each
other launcher's first launch, and labkit's against 1 s. One more row, "labkit lesson 00": the first
launch(RunConfig(world_size=2, steps=3)) of lesson 00 (tinylm: transformers' GPT-2 in DDP), first step from its
records.

accelerate (the `bench` extra: pip install -c requirements.lock -e ".[bench]") is optional: without it, its
row is left out and said so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
FIRST_LAUNCH_BUDGET_S = 1.0

PLAIN_FORK = """_port = w.free_port()
_procs = [mp.get_context("fork").Process(target=w.plain_rank, args=(r, 2, _port)) for r in range(2)]
for _p in _procs: _p.start()
for _p in _procs: _p.join()"""

# launcher -> (cell 1's import, the launch itself)
LAUNCHERS = {
    "labkit": ("import labkit", "labkit.launch(w.labkit_rank, world_size=2)"),
    "plain fork": ("import multiprocessing as mp", PLAIN_FORK),
    "mp.spawn": ("import torch.multiprocessing as tmp",
                 "tmp.spawn(w.plain_rank, args=(2, w.free_port()), nprocs=2)"),
    "notebook_launcher": ("from accelerate import notebook_launcher",
                          "notebook_launcher(w.accelerate_rank, num_processes=2, use_port=str(w.free_port()))"),
    "labkit lesson 00": ("import labkit", "labkit.launch(labkit.RunConfig(world_size=2, steps=3))"),
}

LAUNCH_CELL = """_out = os.path.join({scratch!r}, "first-step-{n}")
os.environ["FIRST_STEP_OUT"] = _out
_t0 = time.time()
_r = None
{launch}
_t1 = time.time()
_end = float(open(_out).read()) if os.path.exists(_out) else float(_r.df["time"].min())
_launches.append({{"first_step_s": _end - _t0, "call_s": _t1 - _t0}})"""


@dataclass
class Sample:
    launcher: str
    import_s: float        # cell 1
    first_s: float         # cell 3: the call -> rank 0's first step ended
    later_s: float         # cell 4, the same in the same kernel
    first_call_s: float    # cell 3: the whole call (ranks started, stepped, stopped)


def run_kernel(launcher: str, pause: float, scratch: Path) -> Sample:
    """One fresh kernel: import, pause, launch twice; the timings it printed."""
    from jupyter_client import KernelManager
    imports, launch = LAUNCHERS[launcher]
    if launcher.startswith("labkit") and " = " not in launch:
        launch = "_r = " + launch
    cells = [f"import time, os, sys, json\n_t = time.perf_counter()\nsys.path.insert(0, {str(BENCH)!r})\n"
             f"import torch\nimport launch_workers as w\n{imports}\n_import_s = time.perf_counter() - _t\n_launches = []",
             f"time.sleep({pause})"]
    cells += [LAUNCH_CELL.format(scratch=str(scratch), n=n, launch=launch) for n in (1, 2)]
    cells.append('print("RESULT " + json.dumps({"import_s": _import_s, "launches": _launches}))')
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
                raise RuntimeError(f"{launcher}: a cell failed:\n{cell}\n{''.join(printed)[-1500:]}\n"
                                   f"kernel and ranks said:\n{(scratch / 'kernel.log').read_text()[-3000:]}")
        line = next(l for l in "".join(printed).splitlines() if l.startswith("RESULT "))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        kernel_log.close()
    out = json.loads(line[len("RESULT "):])
    first, later = out["launches"]
    return Sample(launcher, out["import_s"], first["first_step_s"], later["first_step_s"], first["call_s"])


def available(launchers: list[str]) -> tuple[list[str], list[str]]:
    """The launchers importable here, and those left out (accelerate is an optional extra)."""
    import importlib.util
    no_accelerate = importlib.util.find_spec("accelerate") is None
    missing = [name for name in launchers if name == "notebook_launcher" and no_accelerate]
    return [name for name in launchers if name not in missing], missing


def measure(samples: int, pause: float, launchers: list[str] | None = None) -> dict[str, list[Sample]]:
    """`samples` fresh kernels per launcher, the launchers in a rotated order each round."""
    names, _ = available(launchers or list(LAUNCHERS))
    out: dict[str, list[Sample]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="labkit-first-launch-") as scratch:
        for i in range(samples):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                out[name].append(sample_once_more_if_it_fails(name, pause, Path(scratch) / f"{name.replace(' ', '-')}-{i}"))
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
            for k in ("import_s", "first_s", "later_s", "first_call_s")}


def rows(results: dict[str, list[Sample]]) -> list[tuple[str, float, float, float, str]]:
    """(what, labkit's seconds, the other's seconds, ratio, target) for the summary table (bench/all.py).
    Seconds from the launch call to the end of rank 0's first step, medians over fresh kernels."""
    m = {name: medians(s) for name, s in results.items()}
    lab, others = m["labkit"], [name for name in m if not name.startswith("labkit")]
    out = [(f"1st launch in a kernel (s): labkit / {other}", lab["first_s"], m[other]["first_s"], "<= 1")
           for other in others]
    out.append(("1st launch in a kernel (s): labkit / 1 s budget", lab["first_s"], FIRST_LAUNCH_BUDGET_S, "< 1"))
    if "labkit lesson 00" in m:
        out.append(("lesson 00's 1st launch(RunConfig) (s) / 1 s budget", m["labkit lesson 00"]["first_s"],
                    FIRST_LAUNCH_BUDGET_S, "< 1"))
    out += [(f"import cell + 1st launch (s): labkit / {other}", lab["import_s"] + lab["first_s"],
             m[other]["import_s"] + m[other]["first_s"], "") for other in others]
    out += [(f"2nd launch in a kernel (s): labkit / {other}", lab["later_s"], m[other]["later_s"], "")
            for other in others]
    return [(what, ours, theirs, ours / theirs, target) for what, ours, theirs, target in out]


def report(results: dict[str, list[Sample]], pause: float) -> None:
    print(f"\nfresh kernel per sample; 2 ranks; seconds, median of {len(next(iter(results.values())))} kernels "
          f"(min-max)\n  {'launcher':<20}{'import cell':>14}{'1st launch':>18}{'2nd launch':>18}{'1st call':>12}")
    for name, samples in results.items():
        med = medians(samples)
        spread = {k: (min(getattr(s, k) for s in samples), max(getattr(s, k) for s in samples))
                  for k in ("first_s", "later_s")}
        print(f"  {name:<20}{med['import_s']:>14.2f}"
              + "".join(f"{med[k]:>8.2f} ({lo:.2f}-{hi:.2f})" for k, (lo, hi) in spread.items())
              + f"{med['first_call_s']:>12.2f}")
    if FAILED_SAMPLES:
        print(f"  {len(FAILED_SAMPLES)} launch(es) failed and were run again: "
              + "; ".join(f.splitlines()[0] for f in FAILED_SAMPLES))
    if "labkit" not in results:
        return
    print(f"\n  {'ratio (the cell pauses ' + format(pause, 'g') + ' s after the import)':<56}{'labkit':>8}{'other':>8}"
          f"{'ratio':>8}  target")
    for what, ours, theirs, ratio, target in rows(results):
        print(f"  {what:<56}{ours:>8.2f}{theirs:>8.2f}{ratio:>8.2f}  {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3, help="fresh kernels per launcher")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between the import cell and the launch")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated, from: " + ", ".join(LAUNCHERS))
    args = parser.parse_args()
    names, missing = available(args.launchers.split(","))
    if missing:
        print(f"left out (not installed): {missing}; pip install -c requirements.lock -e '.[bench]'")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    started = time.perf_counter()
    results = measure(args.samples, args.pause, names)
    report(results, args.pause)
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average after: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
