"""Pay, when labkit is imported in a notebook, the imports every forked rank would otherwise pay at its first step.

    import labkit        # in a Jupyter kernel: also imports torch._dynamo and transformers' GPT-2 (a few seconds)
    labkit.launch(cfg)   # the first launch forks ranks that are warm already, like every later one

A rank's first DistributedDataParallel(...) imports torch._dynamo (about 800 modules) and the tiny GPT-2 imports
transformers: seconds of work that a forked rank inherits for free if its parent did it first. In a notebook that
happens once per kernel, in the `import labkit` cell, instead of in the learner's first launch. Scripts, tests and
the CLI skip it (LABKIT_PREWARM=1 forces it, =0 turns it off); their first fork-launch imports what it needs.

Why not in a background thread, so that it would cost no waiting at all: a thread importing transformers while the
notebook's own code imported from it made `from transformers import GPT2Config` fail (transformers resolves its
names lazily, and not safely across threads), and a fork while another thread is half-way through an import leaves
the child holding a module lock nobody will release. Importing up front has neither hazard.
"""
from __future__ import annotations

import importlib
import os

from ..view.show import in_notebook

MODULES = ("torch._dynamo", "torch.nn.parallel", "transformers.models.gpt2.modeling_gpt2")

failed: dict[str, str] = {}  # module -> why it could not be imported ahead (the rank imports it, and reports)


def warm(modules: tuple[str, ...] = MODULES) -> None:
    """Import `modules` now; an optional speed-up, so a failure is remembered rather than raised."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the rank will import it itself and report what goes wrong
            failed[name] = f"{type(exc).__name__}: {exc}"


def warm_on_import() -> None:
    """What `import labkit` does: warm() in a notebook kernel, or when LABKIT_PREWARM=1; never when it is 0."""
    wanted = os.environ.get("LABKIT_PREWARM", "")
    if wanted in ("0", "false", "False"):
        return
    if wanted in ("1", "true", "True") or in_notebook():
        warm()
