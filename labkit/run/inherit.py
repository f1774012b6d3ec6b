"""What a rank forked from this process would inherit without being told, handed to a rank forked from the warm
process instead: the environment variables set or removed since the warm process started, the working directory,
sys.path, the random generators' states, and torch's global switches.

    state = Inherited.capture(environ_at_fork)     # in the launching process, at each launch
    state.apply()                                  # in the rank, before the launched function is unpickled

A forked rank starts as an exact copy of its parent: `torch.manual_seed(0)` in a cell, then a launch, and the
ranks draw what the cell would have drawn next (lesson 08 shows it). Python's own `random` is the exception: it is
re-seeded in every forked child, from either parent, so it is not carried. What the launched function refers to
travels with it by value (cloudpickle: a cell's globals, closures, classes defined in cells); patched functions of
imported modules are not carried but detected (run/patches.py), and then the ranks are forked from this process.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch


def switches() -> dict[str, Any]:
    """torch's process-wide switches that a cell may have flipped (each one applied in the rank as it is here)."""
    return {"deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "default_dtype": torch.get_default_dtype(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "anomaly": torch.is_anomaly_enabled()}


def _set_switches(values: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(values["deterministic"], warn_only=values["deterministic_warn_only"])
    torch.set_default_dtype(values["default_dtype"])
    torch.set_float32_matmul_precision(values["float32_matmul_precision"])
    torch.backends.cudnn.deterministic = values["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = values["cudnn_benchmark"]
    torch.autograd.set_detect_anomaly(values["anomaly"])


@dataclass(frozen=True)
class Inherited:
    """This process's state as a forked rank would find it (see the module docstring)."""

    environ_set: dict[str, str]
    environ_unset: tuple[str, ...]
    cwd: str
    sys_path: tuple[str, ...]
    torch_rng: Any
    numpy_rng: Any
    switches: dict[str, Any]

    @classmethod
    def capture(cls, environ_at_fork: dict[str, str] | None = None) -> "Inherited":
        """Now, in the launching process. environ_at_fork: the environment the warm process has (None: it started
        from another environment, so every variable is carried)."""
        now, before = dict(os.environ), environ_at_fork if environ_at_fork is not None else {}
        numpy = sys.modules.get("numpy")
        return cls(environ_set={k: v for k, v in now.items() if before.get(k) != v},
                   environ_unset=tuple(k for k in before if k not in now) if environ_at_fork is not None else (),
                   cwd=os.getcwd(), sys_path=tuple(sys.path), torch_rng=torch.get_rng_state(),
                   numpy_rng=numpy.random.get_state() if numpy is not None else None, switches=switches())

    def apply(self) -> None:
        """In the rank: become what a rank forked from the launching process would have been."""
        for name in self.environ_unset:
            os.environ.pop(name, None)
        os.environ.update(self.environ_set)
        os.chdir(self.cwd)
        sys.path[:] = list(self.sys_path)
        torch.set_rng_state(self.torch_rng)
        if self.numpy_rng is not None:
            import numpy
            numpy.random.set_state(self.numpy_rng)
        _set_switches(self.switches)
