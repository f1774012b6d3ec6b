"""What each configuration field accepts, as small rules: a rule returns None for an allowed value, else a phrase
saying what is allowed.

    RULES["world_size"](3)      # None
    RULES["world_size"](0)      # "must be an integer >= 1"
    RULES["no_sync"](7)         # "must be True or False"

RunConfig checks every field with its rule before anything starts (config.py), so a wrong type is reported with
the field's name, not later inside JSON or a rank. A new RunConfig field needs a rule here (a test checks that
every field has one).
"""
from __future__ import annotations

import math
from typing import Any, Callable

Rule = Callable[[Any], "str | None"]


def is_int(value: Any) -> bool:
    """An integer that is not a bool (True is an int in Python, never a count of anything here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def one_of(*options: str) -> Rule:
    def rule(value: Any) -> str | None:
        return None if isinstance(value, str) and value in options else f"must be one of {', '.join(options)}"
    return rule


def integer(low: int, high: int | None = None) -> Rule:
    def rule(value: Any) -> str | None:
        if is_int(value) and value >= low and (high is None or value <= high):
            return None
        return f"must be an integer >= {low}" + (f" and <= {high}" if high is not None else "")
    return rule


def number(low: float, *, inclusive: bool = True, high: float | None = None) -> Rule:
    """A finite int or float above `low` (or at it, when inclusive), at most `high` when given."""
    def rule(value: Any) -> str | None:
        if is_number(value) and math.isfinite(value) and (value >= low if inclusive else value > low) \
                and (high is None or value <= high):
            return None
        bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        return f"must be a finite number {bound}"
    return rule


def optional(inner: Rule, meaning: str) -> Rule:
    """None (which means `meaning`) or a value `inner` allows."""
    def rule(value: Any) -> str | None:
        if value is None:
            return None
        why = inner(value)
        return None if why is None else f"must be None ({meaning}) or {why.removeprefix('must be ')}"
    return rule


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def text(value: Any) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def shown(value: Any, limit: int = 80) -> str:
    """repr(value), cut short: an error message names the value without flooding the screen."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
