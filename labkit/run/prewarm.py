"""The imports every rank needs, paid ahead: by labkit's warm process, started when labkit is imported in a
notebook, so that neither the import cell nor the first launch waits for them.

    import labkit        # in a Jupyter kernel: forks the warm process (milliseconds) and returns
    labkit.launch(cfg)   # ranks fork from the warm process, which has imported torch._dynamo, transformers' GPT-2
                         # and labkit's training loop meanwhile (run/warm.py says when, and when not)

A rank's first DistributedDataParallel(...) imports torch._dynamo (about 800 modules) and the tiny GPT-2 imports
transformers: seconds of work that a forked rank inherits for free if its parent did it first. The kernel used to
do it in the `import labkit` cell (11 s where `import torch` takes 3); a background thread in the kernel raced
transformers' lazy imports, and a fork while another thread is half-way through an import leaves the child holding
a module lock nobody will release. The warm process is another process: it imports while the learner reads, and
the kernel imports none of it.

Scripts, tests and the CLI start no warm process at import (LABKIT_PREWARM=1 starts one, =0 never uses one); their
first fork-launch imports what it needs in the launching process (warm_here), and a launch after CUDA was
initialised starts one then (warm.py).
"""
from __future__ import annotations

import importlib
import os
import sys

# What a launching process imports before forking ranks itself (a forked rank inherits them); transformers' GPT-2
# only when the task needs it (training.tasks.preload).
RANK_MODULES = ("torch._dynamo", "torch.nn.parallel")
# What the warm process imports before it answers: the same, the tiny GPT-2, and what a rank runs.
WARM_PROCESS_MODULES = RANK_MODULES + ("transformers.models.gpt2.modeling_gpt2", "labkit.run.rank",
                                       "labkit.run.inherit", "labkit.run.patches", "labkit.training.loop",
                                       "cloudpickle")

failed: dict[str, str] = {}  # module -> why it could not be imported ahead (the rank imports it, and reports)


def warm(modules: tuple[str, ...] = RANK_MODULES) -> None:
    """Import `modules` now; an optional speed-up, so a failure is remembered rather than raised."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the rank will import it itself and report what goes wrong
            failed[name] = f"{type(exc).__name__}: {exc}"


def is_warm(modules: tuple[str, ...] = RANK_MODULES) -> bool:
    """Whether this process has imported `modules` already (a rank forked from it then starts warm)."""
    return all(name in sys.modules for name in modules)


def wanted() -> bool | None:
    """LABKIT_PREWARM: True (=1: a warm process at import, anywhere), False (=0: never one), None (unset: at import
    in a notebook, and when a launch after CUDA needs one)."""
    value = os.environ.get("LABKIT_PREWARM", "")
    if value in ("0", "false", "False"):
        return False
    if value in ("1", "true", "True"):
        return True
    return None


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython, a script or pytest); never imports IPython itself."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and hasattr(shell, "kernel")
