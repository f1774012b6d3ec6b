"""Pay, in the background, the imports every forked rank would otherwise pay at its first step.

    import labkit        # starts the background import (LABKIT_PREWARM=0 turns it off)
    ...                  # a learner reads the first cells: the imports finish meanwhile
    labkit.launch(cfg)   # waits for them if they are still running, then forks warm ranks

A rank's first DistributedDataParallel(...) imports torch._dynamo (about 800 modules) and the tiny GPT-2 imports
transformers: seconds of work that a forked rank inherits for free if its parent did it first. Doing it when
labkit is imported, in a thread, makes a learner's first launch as fast as the later ones.

Forking while another thread is half-way through an import would leave the child with a module lock that no
thread of its own holds: its next import of that module would hang forever. So no process forks while the import
runs: an os.register_at_fork hook makes every fork in this process, labkit's or anyone's (a DataLoader, a
subprocess), wait for it first.
"""
from __future__ import annotations

import importlib
import os
import threading

MODULES = ("torch._dynamo", "torch.nn.parallel", "transformers.models.gpt2.modeling_gpt2")
FORK_WAIT_S = 120.0  # a fork waits at most this long for the import (it normally takes a few seconds)

_thread: threading.Thread | None = None
_failed: dict[str, str] = {}


def start() -> None:
    """Import MODULES in a background thread, once per process (not in forked children: they inherit them)."""
    global _thread
    if _thread is not None or os.environ.get("LABKIT_PREWARM", "1") in ("0", "false", "False"):
        return
    _thread = threading.Thread(target=_import_all, name="labkit-prewarm", daemon=True)
    os.register_at_fork(before=_before_fork)
    _thread.start()


def wait(timeout: float | None = None) -> bool:
    """Block until the background import is done; True if it is (or never started)."""
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    return not thread.is_alive()


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an optional speed-up: the rank will import (and report) it itself
            _failed[name] = f"{type(exc).__name__}: {exc}"


def _before_fork() -> None:
    wait(FORK_WAIT_S)
