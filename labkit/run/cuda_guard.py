"""Which call initialised CUDA in this process: the reason fork is no longer safe, named for the user.

    from labkit.cuda_guard import cuda_init_culprit
    cuda_init_culprit()   # None while CUDA is untouched; else the file and line of the call that initialised it
    fork_poisoned_by()    # why forked ranks could not use the GPUs though CUDA is untouched here (torchao), or None

Importing labkit wraps torch.cuda._lazy_init, the one function every CUDA initialisation goes through (tensor
creation on a GPU included), to remember its caller. CUDA initialised before labkit was imported is reported
as such, with the advice to import labkit first.
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Callable

import torch

from ..constraints import torchao_available

# Library frames are told apart by the file of the module they run in, never by a substring of the path: a checkout
# named "labkit" (as the README clones it) or a user's project folder called "torch" must not hide the user's call.
_LIBRARY_DIRS = (Path(__file__).resolve().parents[1], Path(torch.__file__).resolve().parent)

_cuda_init_stack: list[traceback.FrameSummary] | None = None
_cuda_initialised_before_labkit = torch.cuda.is_initialized()


def tracking(original: Callable[[], None], is_initialized: Callable[[], bool]) -> Callable[[], None]:
    """Wrap a CUDA initialiser so that the first call that succeeds leaves its caller's stack behind."""
    def tracking_lazy_init() -> None:
        global _cuda_init_stack
        first = not is_initialized()
        original()  # raises on a CPU-only build: then nothing was initialised and nothing is remembered
        if first and _cuda_init_stack is None and is_initialized():
            _cuda_init_stack = traceback.extract_stack()[:-1]

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
    users = [frame for frame in _cuda_init_stack if not is_library_file(frame.filename)]
    where = (users or _cuda_init_stack)[-3:]
    return "CUDA was initialised by this call:\n" + "".join(traceback.format_list(where)).rstrip()


def fork_poisoned_by() -> str | None:
    """Why ranks forked here or from labkit's warm process could not use this machine's GPUs, though CUDA may read as
    not initialised, or None. On a GPU machine a process that has imported torchao (the fp8 extra) forks children
    that cannot initialise CUDA ("Cannot re-initialize CUDA in forked subprocess"; measured on an H200 with torchao
    0.18 and torch 2.11, without labkit too: bench/fork_probe.py), and transformers imports torchao with its model
    code whenever it is installed, in the warm process too. torch.cuda.device_count() asks NVML, which forks safely."""
    if not torchao_available():
        return None
    if torch.cuda.device_count() > 0:
        return ("torchao is installed (transformers imports it), and on a GPU machine a process that has imported it "
                "forks children that cannot initialise CUDA")
    return None


def is_library_file(filename: str) -> bool:
    """True for a file inside the labkit or torch package (their own modules), False for anyone else's code."""
    if not os.path.isabs(filename):
        return False  # "<stdin>", "<string>", a notebook cell's pseudo-file: the user's
    path = Path(filename).resolve()
    return any(path.is_relative_to(directory) for directory in _LIBRARY_DIRS)


_install_cuda_init_tracker()
