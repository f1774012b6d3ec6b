"""labkit: run real distributed PyTorch training from a notebook, record every step, compare runs side by side.

    import labkit
    one = labkit.launch(labkit.RunConfig(world_size=1, global_batch=32, steps=30))
    two = labkit.launch(labkit.RunConfig(world_size=2, global_batch=32, steps=30))
    labkit.compare([one, two])          # throughput | loss | learning rate
    two.summary()                       # median throughput, final loss, time to first step

Your own function runs the same way: labkit.launch(fn, world_size=2), where fn(ctx) may be defined in a cell.
"""
from .config import ConfigError, Fault, RunConfig, pick, quick_mode
from .launch import LaunchError, RankFailure, launch
from .loop import NonFiniteLoss, train
from .plot import compare
from .rank import RankContext
from .records import Run, load_run

__version__ = "0.1.0"

__all__ = ["RunConfig", "Fault", "ConfigError", "pick", "quick_mode", "launch", "LaunchError", "RankFailure",
           "train", "NonFiniteLoss", "compare", "RankContext", "Run", "load_run"]
