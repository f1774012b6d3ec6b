"""How a RunConfig and a run's summary read in a notebook and a terminal: what differs from the defaults first, numbers
rounded to what was measured.

    cfg                       # RunConfig(world_size=2, steps=30): the fields that differ from the defaults
    cfg.table()               # every field: value, default, changed (a DataFrame, changed fields first)
    run.summary()             # still a dict; shown as {'samples_per_s': 507.0, ...} and, in Jupyter, a small table

The plain text stays valid Python: eval(repr(cfg)) == cfg, since every field left out has its default.
"""
from __future__ import annotations

import dataclasses
import html
import math
from typing import Any

SIGNIFICANT = 4  # digits a summary shows: its timings vary by more than 0.1% from run to run


def changed_fields(config: Any) -> list[tuple[str, Any, Any]]:
    """(name, value, default) of every field of a dataclass instance whose value is not its default."""
    out = []
    for f in dataclasses.fields(config):
        default = _default(f)
        value = getattr(config, f.name)
        if default is dataclasses.MISSING or value != default:
            out.append((f.name, value, default))
    return out


def config_repr(config: Any) -> str:
    """RunConfig(world_size=2, steps=30): the class and the fields that differ from the defaults."""
    return f"{type(config).__name__}({', '.join(f'{name}={value!r}' for name, value, _ in changed_fields(config))})"


def config_table(config: Any) -> Any:
    """Every field as a row (value, default, changed), the changed ones first, in field order otherwise."""
    import pandas as pd
    changed = {name for name, _, _ in changed_fields(config)}
    rows = [{"field": f.name, "value": getattr(config, f.name), "default": _default(f), "changed": f.name in changed}
            for f in dataclasses.fields(config)]
    table = pd.DataFrame(rows)
    return table.sort_values("changed", ascending=False, kind="stable").set_index("field")


def config_html(config: Any) -> str:
    """A compact HTML view: the changed fields in a table, every other field folded away below it."""
    changed = changed_fields(config)
    names = {name for name, _, _ in changed}
    rest = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in names]
    cells = "".join(f"<tr><td><code>{html.escape(n)}</code></td><td><b>{html.escape(repr(v))}</b></td>"
                    f"<td style='color:#888'>default {html.escape(repr(d))}</td></tr>" for n, v, d in changed)
    folded = ", ".join(f"<code>{html.escape(n)}</code>={html.escape(repr(v))}" for n, v in rest)
    head = f"<b>{html.escape(type(config).__name__)}</b>: {len(changed)} field{'s' if len(changed) != 1 else ''} " \
           f"changed from the defaults"
    return (f"<div>{head}<table>{cells}</table>"
            f"<details><summary>the other {len(rest)} fields (defaults)</summary><small>{folded}</small></details>"
            "</div>")


def rounded(value: Any, digits: int = SIGNIFICANT) -> Any:
    """A float to `digits` significant figures (507.0 for 506.96322); other values as they are."""
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value) or value == 0:
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


class Summary(dict):
    """A run's headline figures: a plain dict (index it, json.dumps it), shown rounded."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {rounded(v)!r}" for k, v in self.items()) + "}"

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td><code>{html.escape(str(k))}</code></td><td>{html.escape(str(rounded(v)))}</td></tr>"
                       for k, v in self.items())
        return f"<table>{rows}</table>"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING
