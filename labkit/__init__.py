"""labkit: run real distributed PyTorch training from a notebook, record every step, compare runs side by side.

    import labkit
    one = labkit.launch(labkit.RunConfig(world_size=1, global_batch=32, steps=30))
    two = labkit.launch(labkit.RunConfig(world_size=2, global_batch=32, steps=30))
    labkit.compare([one, two])          # throughput | loss | learning rate
    two.summary()                       # median throughput, final loss, time to first step
    labkit.panel(two.config)            # knobs, Run/Stop, live figure: explore without editing code

Your own function runs the same way: labkit.launch(fn, world_size=2), where fn(ctx) may be defined in a cell.
Your own script, unchanged, under labkit's eyes: labkit.watch(["torchrun", "--nproc-per-node", "2", "train.py"]).

The package, from the ground up (each room imports only from the rooms before it; README's Layout has every file):
    config.py, rundir.py, records.py, memory.py   the base: what a run is, what it leaves on disk, ZeRO's formulas
    training/               what runs inside a rank: the loop, tasks, data, lr, parallel/ strategies, state/
    view/                   what a person looks at: figures, the live view, a run in a terminal
    run/                    starting and watching ranks: launch, one rank session for both launchers, failures
    measure/, app/          measuring speed honestly; the control panel (labkit.panel)
    tricks/                 the science behind each lesson
    exercises/              build DDP and ZeRO yourself (labkit.exercises)
    cli.py                  python -m labkit ...
"""
import importlib
import logging
import sys
from pathlib import Path

# The one place the version is written: pyproject.toml reads it (dynamic, attr), `labkit --version` prints it.
__version__ = "0.1.0"

from .config import ConfigError, Fault, RunConfig, pick, quick_mode  # noqa: E402
from .dims import ParallelDims  # noqa: E402
from . import memory  # noqa: E402

# Imported at first use, so that `import labkit` costs about what `import torch` does: the launcher and the records
# bring pandas, the figures matplotlib, the training loop transformers.
_LAZY = {"Run": ".records", "load_run": ".records", "launch": ".run", "LaunchError": ".run", "RankFailure": ".run",
         "RankContext": ".run", "NonFiniteLoss": ".training.loop", "train": ".training.loop",
         "make_task": ".training.tasks", "Claims": ".measure", "ClaimFailed": ".measure",
         "watch": ".tricks.watched", "watch_report": ".tricks.watched"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))



def compare(runs, **options):
    """Throughput | loss | learning rate of `runs`, one line each, side by side; shown once in a notebook:

        labkit.compare([one, two])             # options: x="samples", smooth=5, labels=[...], title="..."

    labkit.view.compare, imported at the first call (matplotlib is not imported by `import labkit`)."""
    from .view import compare as draw
    return draw(runs, **options)


def curves(runs, column: str, **options):
    """One recorded quantity of several runs (mean over ranks), one line each:  labkit.curves(runs, "grad_norm").
    Options: x, labels, title, ylabel. labkit.view.curves, imported at the first call."""
    from .view import curves as draw
    return draw(runs, column, **options)


def panel(config: RunConfig | None = None, **options):
    """A control panel that launches runs: knobs for `fields` of `config`, Run and Stop, a bar per run, the live
    side-by-side figure, and past runs to tick (labkit/app/panel.py):

        labkit.panel(RunConfig(steps=40), fields=["world_size", "lr", "clip_norm", "faults"])

    options: fields (names, or {tab title: names}), runs_root, timeout and max_restarts (launch's), past
    ("session" or "all"), live_every_s (None: draw the figure only when a run ends)."""
    from .app.panel import Panel
    return Panel(config if config is not None else RunConfig(), **options)


__all__ = ["RunConfig", "ParallelDims", "Fault", "ConfigError", "pick", "quick_mode", "launch", "LaunchError", "RankFailure",
           "train", "NonFiniteLoss", "compare", "curves", "panel", "RankContext", "Run", "load_run", "memory",
           "make_task", "Claims", "ClaimFailed"]


def _for_the_command_line() -> bool:
    """Whether the command line is importing labkit (`python -m labkit ...`, or the `labkit` script) before it has
    parsed its arguments: then torch waits for cli.py to call _import_the_rest(), so that --help and --version
    answer in a fraction of a second. Everything is still reachable: the names above import at first use."""
    if sys.argv[:1] == ["-m"]:  # `python -m <module>` while <module> is being found: the module is in orig_argv
        after = [b if a == "-m" else a[2:] for a, b in zip(sys.orig_argv, sys.orig_argv[1:] + [""])
                 if a.startswith("-m")]
        return after[:1] in (["labkit"], ["labkit.cli"], ["labkit.__main__"])
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return Path(script).name == "labkit"  # the console script pip writes ([project.scripts] in pyproject.toml)


def _import_the_rest() -> None:
    """The part of `import labkit` that imports torch: the CUDA tracker (run/cuda_guard.py), then, in a notebook,
    the warm process forked from here (run/warm.py). Last, once this module is whole; at most once."""
    if globals().get("_warm") is not None:
        return
    from . import run  # noqa: F401 - the CUDA tracker
    from .run import warm
    globals()["_warm"] = warm
    warm.start_on_import()


class _CpuOnlyNoise:
    """A logging filter for two messages torchao 0.18 (the fp8 extra) logs on a CPU-only host whenever transformers
    imports it, i.e. in every rank that builds a model: its GPU kernels' .so files that cannot load here ("Failed to
    load .../torchao/_C_...so"), and torch's deprecation note on two of its Enums ("is an Enum subclass and is now
    natively supported by torch.compile"). Neither changes what runs on CPU; on a host with CUDA both still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        noise = ((text.startswith("Failed to load ") and "/torchao/_C" in text)
                 or ("is an Enum subclass and is now natively supported by torch.compile" in text))
        if not noise:
            return True
        cuda = sys.modules.get("torch.cuda")
        return bool(cuda is not None and cuda.is_available())


for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).addFilter(_CpuOnlyNoise())

if not _for_the_command_line():
    _import_the_rest()
