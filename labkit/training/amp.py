"""Mixed precision inside the loop: the autocast context, and whether each optimizer step really happened.

    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    taken = StepCounter(optimizer)           # counts the optimizer's real steps
    with autocast("fp16", device):
        loss = model(inputs)
    scaler.scale(loss).backward()
    before = taken.steps
    scaler.step(optimizer); scaler.update()
    skipped = taken.steps == before          # GradScaler found an inf/NaN gradient and did not step

labkit.train records `loss_scale` (what the step's loss was multiplied by before backward; 1.0 without a scaler)
and `skipped_step` (1 when the optimizer did not step) this way. A skip is seen, not inferred from the scale.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Mixed-precision context for fp16/bf16; nothing for fp32:  with autocast("bf16", torch.device("cpu")): ...
    Nothing for fp8 either: its layers quantise their own matmuls' inputs (training/fp8_layers.py), the rest is fp32."""
    if precision in ("fp32", "fp8"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class StepCounter:
    """How many times `optimizer.step()` really ran: a post-step hook on the optimizer counts them.

        taken = StepCounter(optimizer); ...; taken.steps"""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.steps = 0
        self._handle = optimizer.register_step_post_hook(self._count)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1

    def remove(self) -> None:
        self._handle.remove()
