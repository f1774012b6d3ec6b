"""Starting and watching ranks: launch() forks or spawns them, watches their heartbeats, and turns a crash, an
error or a hang into one RankFailure that names the rank, its step and why; nothing is left running.

    launch.py      start ranks (from this process, from the warm process, or spawned), watch them, stop them
    session.py     one rank's life under either launcher: join, the RankContext a function receives, the error
                   record, leave
    rank.py        a rank of labkit's launcher: heartbeats, rendezvous, set-up and tear-down around the session
    torchrun.py    a rank torchrun started: its store per attempt, where ranks run, ending together
    diagnose.py    who failed first and why: exit codes, error files, stack dumps of hung ranks
    failure.py     RankStatus and RankFailure, what the launcher reports
    reaping.py     the ranks as OS processes: exit codes without reaping, signals to their groups
    cuda_guard.py  which call initialised CUDA (the reason fork is no longer safe)
    prewarm.py     the imports every rank needs, paid ahead; the warm process started by `import labkit` in a notebook
    warm.py        the warm process from the launching side: start it, ask it to fork ranks, when it may stand in
    zygote.py      the warm process from the inside: import once, fork ranks, report their exits
    patches.py     whether anything a rank runs was patched here since the warm process started
    inherit.py     what a forked rank inherits unasked (environment, RNG, switches), handed to the warm process's
    restarts.py    restarting from the newest checkpoint (max_restarts), resuming another run (resume_from)

Importing this package imports torch (the CUDA tracker) but not launch() and what it needs (pandas, matplotlib):
those come with the first use of a name below, so that `import labkit` returns about as fast as `import torch`.
"""
import importlib
import sys
import types

from . import cuda_guard  # noqa: F401 - its tracker must be in place before any cell runs

_LAZY = {"launch": ".launch", "LaunchError": ".failure", "RankFailure": ".failure", "RankStatus": ".failure",
         "RankContext": ".session"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing the submodule labkit.run.launch binds the package's name `launch` to that module; the name is the
    function (as `from .launch import launch` made it when this package imported everything up front)."""

    def __setattr__(self, name: str, value: object) -> None:
        if not (name == "launch" and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["launch", "LaunchError", "RankFailure", "RankStatus", "RankContext"]
