"""Quick mode: the same lessons and tests at smaller sizes (LABKIT_QUICK=1, which `make test` sets).

    steps = pick(full=200, quick=30)
    quick_mode()     # True under LABKIT_QUICK=1
"""
from __future__ import annotations

import os
from typing import Any


def quick_mode() -> bool:
    """True when LABKIT_QUICK=1 (set by `make test`): lessons run the same cells with smaller sizes."""
    return os.environ.get("LABKIT_QUICK", "") not in ("", "0", "false", "False")


def pick(full: Any, quick: Any) -> Any:
    """Return `quick` in quick mode, else `full`:  steps = pick(full=200, quick=30)."""
    return quick if quick_mode() else full
