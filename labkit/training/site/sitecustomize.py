"""Loaded by Python at start-up in every process of a job `labkit watch` runs (this folder leads PYTHONPATH).

Why a sitecustomize rather than torchrun's `-m`: it reaches every Python process the command starts, whatever
starts it: torchrun's workers, a framework that re-launches its own script for each rank (Lightning), a script run
with plain `python`. It costs nothing in processes that are not ranks (the torchrun agent, a DataLoader worker):
the agent starts only where $RANK is set and no parent already holds it. A user's own sitecustomize, further down
the path, is loaded first, as if this one were not there.
"""
import os
import sys


def _start_agent() -> None:
    if not os.environ.get("LABKIT_WATCH_DIR") or not os.environ.get("RANK", "").strip().isdigit():
        return
    try:
        from labkit.training import agent
        agent.start()
    except Exception as exc:  # never stop the user's job: say why it is not watched
        print(f"labkit watch: rank {os.environ.get('RANK')} is not recorded: {type(exc).__name__}: {exc}",
              file=sys.stderr)


def _load_the_next_sitecustomize() -> None:
    """The sitecustomize this one shadows (a user's, a distribution's), if there is one further down sys.path."""
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_load_the_next_sitecustomize()
_start_agent()
