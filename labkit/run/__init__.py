"""Starting and watching ranks: launch() forks or spawns them, watches their heartbeats, and turns a crash, an
error or a hang into one RankFailure that names the rank, its step and why; nothing is left running.

    launch.py      start ranks (fork when safe, else spawn), watch them, stop them
    rank.py        inside a rank: set-up, the RankContext a function receives, heartbeats, tear-down
    diagnose.py    who failed first and why: exit codes, error files, stack dumps of hung ranks
    failure.py     RankStatus and RankFailure, what the launcher reports
    reaping.py     the ranks as OS processes: exit codes without reaping, signals to their groups
    cuda_guard.py  which call initialised CUDA (the reason fork is no longer safe)
    prewarm.py     the imports every forked rank needs, paid by `import labkit` in a notebook
    restarts.py    restarting from the newest checkpoint (max_restarts), resuming another run (resume_from)
"""
from . import prewarm
from .failure import LaunchError, RankFailure, RankStatus
from .launch import launch
from .rank import RankContext

prewarm.warm_on_import()

__all__ = ["launch", "LaunchError", "RankFailure", "RankStatus", "RankContext"]
