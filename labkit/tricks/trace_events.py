"""What one event of a torch.profiler Chrome trace says about the tensor it handled: its elements and its bytes.

    event_elements({"args": {"Input Dims": [[2, 32, 64]]}})                                  # 4096
    event_bytes({"args": {"Input Dims": [[2, 32, 64]], "Input type": ["float"]}})            # 16384
    event_bytes({"args": {"Input Dims": [[8]]}})                                             # nan: no dtype named

record_shapes=True makes the profiler write "Input Dims" (the first argument's shape, or a list of shapes for a
tensor list) and "Input type" (its dtype, in C++'s spelling). The readers of lesson 16's DDP trace
(exercises/traced.py) and of a pipeline step's trace (pipeline_trace.py) both size gloo's events this way.
"""
from __future__ import annotations

import math
from typing import Any

DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "int": 4, "long int": 8,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
"""Bytes per element of the dtypes a profiler event names ("Input type")."""


def event_elements(event: dict[str, Any]) -> int:
    """Elements of the tensor(s) an event's first argument holds: "Input Dims" [[8, 64]] or, for a tensor list,
    [[[8, 64], [64]]] (a 0-d tensor's shape [] counts 1)."""
    dims = (event.get("args", {}).get("Input Dims") or [[]])[0]
    shapes = dims if dims and isinstance(dims[0], list) else [dims]
    return sum(math.prod(shape) for shape in shapes)


def event_dtype(event: dict[str, Any]) -> str | None:
    """The dtype an event names ("Input type"), or None."""
    return (event.get("args", {}).get("Input type") or [None])[0]


def event_bytes(event: dict[str, Any]) -> float:
    """Bytes of the tensor(s) an event handled, or NaN where it names no dtype, or one not in DTYPE_BYTES."""
    dtype = event_dtype(event)
    return event_elements(event) * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else math.nan
