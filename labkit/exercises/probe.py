"""Watch the collectives a piece of code makes: which, when, how many bytes, whether it waited for them.

    with CommProbe() as probe:
        with probe.phase("backward", step=0):
            loss.backward()                          # hooks calling dist.all_reduce(...) are seen
    probe.events                                     # one dict per call: op, bytes, start, end, async_op, ...

The probe swaps the functions in torch.distributed (all_reduce, broadcast, all_gather, reduce_scatter and their
tensor variants) for wrappers that note each call and then make it. Code that calls them as `dist.all_reduce(...)`
is seen; a name bound before the probe started (`from torch.distributed import all_reduce`) is not.
An async call's end is when its work completed (a callback on its future); a blocking call's end is its return.
Times are time.perf_counter() of the rank; compare them only within one rank.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# For each watched collective: the argument holding what this rank contributes (its bytes are counted).
PAYLOAD = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
           "all_gather_into_tensor": "input_tensor", "_all_gather_base": "input_tensor",
           "reduce_scatter": "input_list", "reduce_scatter_tensor": "input", "_reduce_scatter_base": "input",
           "all_reduce_coalesced": "tensors"}


def payload_bytes(value: Any) -> int:
    """Bytes of a tensor or of a list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return 0


class WatchedWork:
    """Stands in for the Work an async collective returns, noting when it is waited on."""

    def __init__(self, work: Any, event: dict[str, Any]):
        self._work, self._event = work, event

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._event["waited"] = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommProbe:
    """Context manager that records every watched collective made while it is open (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.works: list[tuple[dict[str, Any], Any]] = []
        self.current_phase, self.current_step = "", -1
        self._paused = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "CommProbe":
        for name in PAYLOAD:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            self._saved[name] = original
            watched = self._wrap(name, original)
            setattr(c10d, name, watched)
            if getattr(dist, name, None) is original:
                setattr(dist, name, watched)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            if getattr(dist, name, None) is getattr(c10d, name):
                setattr(dist, name, original)
            setattr(c10d, name, original)
        self._saved.clear()

    def original(self, name: str) -> Any:
        """The unwatched collective (for a checker's own communication)."""
        return self._saved.get(name) or getattr(c10d, name)

    @contextlib.contextmanager
    def phase(self, name: str, step: int = -1) -> Iterator[None]:
        """Label the calls made inside: phase("finish", step=3)."""
        saved = self.current_phase, self.current_step
        self.current_phase, self.current_step = name, step
        try:
            yield
        finally:
            self.current_phase, self.current_step = saved

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Calls made inside are not recorded (a checker's own all-reduces, say)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def of(self, phase: str | None = None, step: int | None = None, op: str | None = None) -> list[dict[str, Any]]:
        """The recorded events that match every filter given."""
        return [e for e in self.events if (phase is None or e["phase"] == phase)
                and (step is None or e["step"] == step) and (op is None or e["op"] == op)]

    def unfinished(self, step: int) -> int:
        """Async collectives of `step` whose work had not completed when this is asked."""
        return sum(1 for event, work in self.works if event["step"] == step and not work.is_completed())

    def _wrap(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)

        def watched(*args: Any, **kwargs: Any) -> Any:
            if self._paused:
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs)
            payload = bound.arguments.get(PAYLOAD[name])
            first = payload[0] if isinstance(payload, (list, tuple)) and payload else payload
            op = bound.arguments.get("op")
            event = {"op": name, "bytes": payload_bytes(payload), "phase": self.current_phase,
                     "step": self.current_step, "async_op": bool(bound.arguments.get("async_op", False)),
                     "ptr": first.data_ptr() if isinstance(first, torch.Tensor) else 0,
                     "reduce_op": str(op).split(".")[-1] if op is not None else "",
                     "src": bound.arguments.get("src"), "waited": False, "start": time.perf_counter(), "end": None}
            self.events.append(event)
            result = original(*args, **kwargs)
            if event["async_op"] and result is not None:
                self._note_completion(result, event)
                self.works.append((event, result))
                return WatchedWork(result, event)
            event["end"] = time.perf_counter()
            return result

        watched.__wrapped__ = original  # type: ignore[attr-defined]
        return watched

    @staticmethod
    def _note_completion(work: Any, event: dict[str, Any]) -> None:
        def done(_: Any) -> None:
            event["end"] = time.perf_counter()
        try:
            work.get_future().add_done_callback(done)
        except (RuntimeError, AttributeError):  # a backend without futures: the end stays unknown
            pass
