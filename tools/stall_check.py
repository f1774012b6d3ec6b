"""Does a notebook stall a headless runner? Count the cells that sat out their whole timeout (jupyter/nbclient#312).

    python tools/stall_check.py cells --runs 60                  # which widget code meets the race, and which not
    python tools/stall_check.py cells --runs 60 --patched        # the same with nbclient's shell send re-checked
    python tools/stall_check.py nbmake notebooks/15_playground.ipynb --runs 30
    python tools/stall_check.py nbmake --control --runs 30       # the harness on ten `interact` cells
    python tools/stall_check.py sends notebooks/15_playground.ipynb   # what nbclient sends back: 0 means no race

A stalled cell does not fail: nbclient finds the execute_reply it missed when its poll times out, and the cell
passes after exactly the per-cell timeout (labkit/app/panel.py's docstring says why). So a stall is seen in time
only: `cells` times each cell of a two-cell notebook under nbclient with a short timeout and counts those that
took the whole timeout; `nbmake` runs `pytest --nbmake` on a notebook again and again, each time in a fresh
process, and counts the runs that took longer than the per-cell timeout; `sends` counts the messages behind the
race itself (nbclient's sends on the shell channel during a cell): none, and no cell can stall. Run it from the
repository root with the kit's environment (.venv/bin/python); it exits 1 on a stall (or a send).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "interact": "import ipywidgets\n@ipywidgets.interact(x=(0, 10))\ndef f(x=3):\n    print('x is', x)\n    return x",
    "output": "import ipywidgets\nfrom IPython.display import display\nout = ipywidgets.Output()\ndisplay(out)\n"
              "with out:\n    print('inside an Output widget')",
    "plain": "import ipywidgets\nfrom IPython.display import display\nb = ipywidgets.Button(description='Run')\n"
             "h = ipywidgets.HTML('not yet')\nb.on_click(lambda _: setattr(h, 'value', 'clicked'))\n"
             "display(ipywidgets.VBox([b, h]))\nb.click()\nassert h.value == 'clicked'",
    "panel": "import labkit, tempfile\n"
             "p = labkit.panel(labkit.RunConfig(world_size=1, steps=2, tensorboard=False, save_final=False),"
             " fields=['world_size', 'lr'], runs_root=tempfile.mkdtemp())\ndisplay(p)\n"
             "p.controls['lr'].widget.value = 0.01\np.run_button.click()\nassert p.wait(60).config.lr == 0.01",
}
SLOW_CELL_S = 60   # the panel variant imports labkit and launches ranks
CONTROL = ("import ipywidgets",) + tuple(
    f"@ipywidgets.interact(x=(0, 10))\ndef f{i}(x={i}):\n    print('x is', x)\n    return x" for i in range(10))
"""The control notebook: ten interact cells, ten chances per run to meet the race."""


def patch_nbclient() -> None:
    """After nbclient's Output stand-in sends on the shell channel, let the asyncio socket look at its events
    again (what a send through that socket would have done): the experiment's control, never used by labkit."""
    from nbclient.output_widget import OutputWidget
    original = OutputWidget._publish_msg

    def publish_and_recheck(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.kernel_client.shell_channel.socket._schedule_remaining_events()
    OutputWidget._publish_msg = publish_and_recheck


def cells(variants: list[str], runs: int, timeout: int, patched: bool) -> int:
    import nbformat
    from nbclient import NotebookClient
    if patched:
        patch_nbclient()
    from nbclient.exceptions import CellTimeoutError
    stalled_any = 0
    for variant in variants:
        limit = max(timeout, SLOW_CELL_S) if variant == "panel" else timeout  # it launches ranks: seconds
        stalls, slow, times = 0, 0, []
        for _ in range(runs):
            nb = nbformat.v4.new_notebook()
            nb.cells = [nbformat.v4.new_code_cell(VARIANTS[variant]), nbformat.v4.new_code_cell("print('next')")]
            marks: dict[str, float] = {}
            try:
                NotebookClient(nb, timeout=limit, kernel_name="python3",
                               on_cell_execute=lambda cell, cell_index: marks.setdefault(f"s{cell_index}",
                                                                                         time.time()),
                               on_cell_executed=lambda cell, cell_index, execute_reply:
                               marks.setdefault(f"d{cell_index}", time.time())).execute()
            except CellTimeoutError:
                slow += 1  # no reply at all within the limit: a slow cell, which a stall is not
                continue
            times.append(marks["d0"] - marks["s0"])
            stalls += times[-1] >= limit
        stalled_any += stalls
        median = f"{sorted(times)[len(times) // 2]:.2f} s" if times else "-"
        print(f"{variant:9s}{' (patched)' if patched else ''}: {stalls} of {runs} cells waited out the {limit} s "
              f"timeout; median cell {median}" + (f"; {slow} timed out for real" if slow else ""), flush=True)
    return stalled_any


def nbmake(notebook: Path, runs: int, timeout: int) -> int:
    env = {**os.environ, "LABKIT_QUICK": "1", "MPLBACKEND": "Agg"}
    env.setdefault("LABKIT_RUNS", tempfile.mkdtemp(prefix="stall-check-runs-"))
    stalls, times = 0, []
    for i in range(runs):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", str(notebook), f"--nbmake-timeout={timeout}",
                               "-q", "-p", "no:cacheprovider"], env=env, capture_output=True, text=True)
        took = time.monotonic() - started
        times.append(took)
        stalled = took >= timeout
        stalls += stalled
        print(f"run {i + 1:2d}: {took:6.1f} s  {'passed' if done.returncode == 0 else 'FAILED'}"
              f"{'  STALLED (took the per-cell timeout)' if stalled else ''}", flush=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-2000:])
            return runs
    ordered = sorted(times)
    print(f"{notebook.name}: {runs} runs, {stalls} stalled; per run min {ordered[0]:.1f} s, median "
          f"{ordered[len(ordered) // 2]:.1f} s, max {ordered[-1]:.1f} s (per-cell timeout {timeout} s)")
    return stalls


def sends(notebook: Path) -> int:
    """Execute `notebook` once under nbclient and count what nbclient sent back on the shell channel during its
    cells (its Output-widget stand-in's messages): zero means the race cannot happen in this notebook."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.output_widget import OutputWidget
    sent, original = [], OutputWidget._publish_msg

    def counting(self, msg_type, *args, **kwargs):
        sent.append(msg_type)
        return original(self, msg_type, *args, **kwargs)
    OutputWidget._publish_msg = counting
    os.environ.setdefault("LABKIT_QUICK", "1")
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}
                   ).execute()
    print(f"{notebook.name}: nbclient sent {len(sent)} message(s) on the shell channel during its cells")
    return len(sent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("cells", help="time one widget cell under nbclient, per variant")
    one.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    one.add_argument("--runs", type=int, default=40)
    one.add_argument("--timeout", type=int, default=8, help="per-cell timeout, seconds")
    one.add_argument("--patched", action="store_true", help="re-check the shell socket after nbclient's send")
    many = sub.add_parser("nbmake", help="run a notebook under nbmake again and again")
    many.add_argument("notebook", type=Path, nargs="?", default=Path("notebooks/15_playground.ipynb"))
    many.add_argument("--runs", type=int, default=30)
    many.add_argument("--timeout", type=int, default=60, help="nbmake's per-cell timeout, seconds")
    many.add_argument("--control", action="store_true", help="run a notebook that uses interact instead")
    count = sub.add_parser("sends", help="count nbclient's shell-channel sends while it runs a notebook once")
    count.add_argument("notebook", type=Path, nargs="?", default=Path("notebooks/15_playground.ipynb"))
    count.add_argument("--control", action="store_true", help="the interact notebook instead")
    args = parser.parse_args()
    if args.mode == "cells":
        return int(cells(args.variants, args.runs, args.timeout, args.patched) > 0)
    notebook = args.notebook
    if args.control:
        import nbformat
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(c) for c in CONTROL]
        notebook = Path(tempfile.mkdtemp()) / "interact_control.ipynb"
        nbformat.write(nb, notebook)
    if args.mode == "sends":
        return int(sends(notebook) > 0)
    return int(nbmake(notebook, args.runs, args.timeout) > 0)


if __name__ == "__main__":
    sys.exit(main())
