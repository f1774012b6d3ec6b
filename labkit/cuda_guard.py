"""Which call initialised CUDA in this process: the reason fork is no longer safe, named for the user.

    from labkit.cuda_guard import cuda_init_culprit
    cuda_init_culprit()   # None while CUDA is untouched; else the file and line of the call that initialised it

Importing labkit wraps torch.cuda._lazy_init, the one function every CUDA initialisation goes through (tensor
creation on a GPU included), to remember its caller. CUDA initialised before labkit was imported is reported
as such, with the advice to import labkit first.
"""
from __future__ import annotations

import traceback
from typing import Callable

import torch

_cuda_init_stack: list[str] | None = None
_cuda_initialised_before_labkit = torch.cuda.is_initialized()


def tracking(original: Callable[[], None], is_initialized: Callable[[], bool]) -> Callable[[], None]:
    """Wrap a CUDA initialiser so that the first call that succeeds leaves its caller's stack behind."""
    def tracking_lazy_init() -> None:
        global _cuda_init_stack
        first = not is_initialized()
        original()  # raises on a CPU-only build: then nothing was initialised and nothing is remembered
        if first and _cuda_init_stack is None and is_initialized():
            _cuda_init_stack = traceback.format_stack()[:-1]

    tracking_lazy_init._labkit_tracker = True  # type: ignore[attr-defined]
    return tracking_lazy_init


def _install_cuda_init_tracker() -> None:
    """Wrap torch.cuda._lazy_init (every path that initialises CUDA goes through it) to remember the caller."""
    if not getattr(torch.cuda._lazy_init, "_labkit_tracker", False):
        torch.cuda._lazy_init = tracking(torch.cuda._lazy_init, torch.cuda.is_initialized)


def cuda_is_initialised() -> bool:
    return torch.cuda.is_initialized()


def cuda_init_culprit() -> str | None:
    """None if CUDA is not initialised here; else a sentence naming the call that initialised it."""
    if not cuda_is_initialised():
        return None
    if _cuda_initialised_before_labkit or _cuda_init_stack is None:
        return ("CUDA was initialised before labkit was imported; import labkit first (top of the notebook) "
                "and it will name the call that does it.")
    outside_torch = [f for f in _cuda_init_stack if "/torch/" not in f and "/labkit/" not in f]
    where = (outside_torch or _cuda_init_stack)[-3:]
    return "CUDA was initialised by this call:\n" + "".join(where).rstrip()


_install_cuda_init_tracker()
