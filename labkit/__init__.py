"""labkit: run real distributed PyTorch training from a notebook, record every step, compare runs side by side.

    import labkit
    one = labkit.launch(labkit.RunConfig(world_size=1, global_batch=32, steps=30))
    two = labkit.launch(labkit.RunConfig(world_size=2, global_batch=32, steps=30))
    labkit.compare([one, two])          # throughput | loss | learning rate
    two.summary()                       # median throughput, final loss, time to first step
    labkit.panel(two.config)            # knobs, Run/Stop, live figure: explore without editing code

Your own function runs the same way: labkit.launch(fn, world_size=2), where fn(ctx) may be defined in a cell.

The package, from the ground up (each room imports only from the rooms before it):
    config.py, records.py   the base: what a run is, and what it leaves on disk
    training/               what runs inside a rank: the loop, tasks, data, schedules, comm hooks, faults, seeds
    view/                   what a person looks at: figures, the live view
    run/                    starting and watching ranks: launch, the rank's side, failure reports
    measure/                measuring speed honestly: pinned cores, who else used them
    tricks/                 the science behind each lesson
    cli.py                  python -m labkit ...
"""
from .config import ConfigError, Fault, RunConfig, pick, quick_mode
from .records import Run, load_run
from .run import LaunchError, RankContext, RankFailure, launch
from .training.loop import NonFiniteLoss, train
from .tricks import memory
from .view import compare, curves

__version__ = "0.1.0"


def panel(config: RunConfig | None = None, **options):
    """A control panel that launches runs: knobs for `fields` of `config`, Run and Stop, a bar per run, the live
    side-by-side figure, and past runs to tick (labkit/view/panel.py):

        labkit.panel(RunConfig(steps=40), fields=["world_size", "lr", "clip_norm", "faults"])

    options: fields (names, or {tab title: names}), runs_root, timeout and max_restarts (launch's), past
    ("session" or "all"), live_every_s (None: draw the figure only when a run ends)."""
    from .view.panel import Panel
    return Panel(config if config is not None else RunConfig(), launch=launch, **options)


__all__ = ["RunConfig", "Fault", "ConfigError", "pick", "quick_mode", "launch", "LaunchError", "RankFailure",
           "train", "NonFiniteLoss", "compare", "curves", "panel", "RankContext", "Run", "load_run", "memory"]
