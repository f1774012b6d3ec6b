"""Learning-rate schedules as pure functions of the step.

    from labkit.schedule import lr_at
    lr_at(0, peak=1e-3, steps=100, warmup_steps=10)                    # 1e-4: first warmup step
    lr_at(99, peak=1e-3, steps=100, schedule="cosine", min_lr_ratio=0.1)  # 1e-4: the floor at the last step
"""
from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, steps: int, warmup_steps: int = 0, schedule: str = "constant",
          min_lr_ratio: float = 0.0) -> float:
    """The learning rate used at optimizer step `step` (0-based)."""
    # 1) linear warmup: step 0 already trains, at peak/warmup, reaching peak after warmup_steps steps
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    # 2) after warmup, progress runs from 0 (first step after warmup) to 1 (the last step)
    decay_steps = steps - warmup_steps - 1
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    floor = peak * min_lr_ratio
    # 3) the shape of the decay from peak down to the floor
    if schedule == "constant":
        return peak
    if schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule = {schedule!r}: must be one of constant, linear, cosine")


def lr_for_config(step: int, config) -> float:
    """lr_at with the schedule fields of a RunConfig:  lr_for_config(step, cfg)."""
    return lr_at(step, peak=config.lr, steps=config.steps, warmup_steps=config.warmup_steps,
                 schedule=config.schedule, min_lr_ratio=config.min_lr_ratio)
