"""A failure to inject on purpose, part of a RunConfig:  Fault(kind="raise", rank=1, step=3).

    RunConfig(world_size=2, steps=10, faults=(Fault(kind="segfault", rank=1, step=3),))
    RunConfig.from_dict({"faults": [{"kind": "slow", "rank": 0, "step": 0, "delay_s": 0.02}]})

What each kind does inside the rank is in labkit/training/inject.py; here is what a fault is, and what makes one
valid (its ranges against world_size and steps are checked by the RunConfig it belongs to).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rules import is_int, number, shown

FAULT_KINDS = ("raise", "segfault", "hang", "nan", "exit", "bad_batch", "slow", "kill_in_save", "clock")
DELAYED = ("slow", "clock")  # the kinds that take delay_s


@dataclass(frozen=True, kw_only=True)
class Fault:
    """A failure to inject on purpose:  Fault(kind="raise", rank=1, step=3).

    kinds: "raise" (a Python exception), "segfault" (SIGSEGV), "hang" (sleep forever), "nan" (a NaN loss),
    "exit" (os._exit(3), a rank that vanishes without a traceback), "bad_batch" (that rank's batch of that step
    is corrupted: labels shuffled, float inputs scaled up; see training/inject.py), "slow" (a straggler: the rank
    sleeps delay_s at the start of every step from `step` on:  Fault(kind="slow", rank=1, step=0, delay_s=0.02)),
    "kill_in_save" (SIGKILL half-way through writing that rank's part of the checkpoint saved after that step:
    training/state/checkpoint.py), "clock" (that rank's wall clock reads delay_s seconds ahead from `step` on: the
    time in its records, and so in its TensorBoard events, as on a node whose clock is off).
    """

    kind: str
    """What happens: one of FAULT_KINDS."""
    rank: int
    """The rank it happens on."""
    step: int
    """The step (0-based) at whose start it happens ("slow": from which on)."""
    delay_s: float = 0.0
    """"slow": seconds the rank loses at the start of each step (a slower GPU, a noisy neighbour); "clock": seconds
    its clock is ahead."""

    def problems(self, world_size: int | None = None, steps: int | None = None) -> list[str]:
        """What is wrong with this fault, as sentences (ranges are checked when world_size and steps are given)."""
        out = []
        if not (isinstance(self.kind, str) and self.kind in FAULT_KINDS):
            out.append(f"Fault.kind = {shown(self.kind)}: must be one of {', '.join(FAULT_KINDS)}")
        for name, size, what in (("rank", world_size, "world_size"), ("step", steps, "steps")):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                out.append(f"Fault.{name} = {shown(value)}: must be an integer >= 0")
            elif size is not None and value >= size:
                out.append(f"Fault.{name} = {value}: must be below {what} = {size}")
        return out + _delay_problems(self.kind, self.delay_s)


FAULT_FIELDS = ("kind", "rank", "step")
FAULT_OPTIONAL = ("delay_s",)


def _delay_problems(kind: Any, delay: Any) -> list[str]:
    why = number(0.0)(delay)
    if why:
        return [f"Fault.delay_s = {shown(delay)}: {why}"]
    if kind == "slow" and delay == 0:
        return ["Fault.delay_s = 0: a \"slow\" fault needs the seconds to lose per step, e.g. delay_s=0.02"]
    if kind == "clock" and delay == 0:
        return ["Fault.delay_s = 0: a \"clock\" fault needs the seconds the clock is ahead, e.g. delay_s=2.5"]
    if kind not in DELAYED and delay != 0:
        return [f"Fault.delay_s = {delay!r}: only a \"slow\" or \"clock\" fault has a delay (kind = {shown(kind)}); "
                "leave it 0"]
    return []


def as_faults(value: Any) -> Any:
    """A tuple of Faults from Faults or dicts with the keys kind, rank, step (and maybe delay_s); anything else is
    returned unchanged."""
    if not isinstance(value, (list, tuple)):
        return value
    items = []
    for item in value:
        if isinstance(item, dict) and set(FAULT_FIELDS) <= set(item) <= set(FAULT_FIELDS + FAULT_OPTIONAL):
            item = Fault(**item)
        if not isinstance(item, Fault):
            return value
        items.append(item)
    return tuple(items)


def fault_shape(value: Any) -> str | None:
    if isinstance(value, tuple) and all(isinstance(f, Fault) for f in value):
        problems = [why for f in value for why in f.problems()]
        return "; ".join(problems) or None
    return ("must be a list of Fault(kind=..., rank=..., step=...), or of dicts with the keys "
            f"{', '.join(FAULT_FIELDS)} (and optionally {', '.join(FAULT_OPTIONAL)})")
