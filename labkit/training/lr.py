"""Learning-rate schedules as pure functions of the step.

    from labkit.training.lr import lr_at, lr_for_config
    lr_at(0, peak=1e-3, steps=100, warmup_steps=10)                      # 1e-4: first warmup step
    lr_at(99, peak=1e-3, steps=100, schedule="cosine", min_lr_ratio=0.1)  # 1e-4: the floor at the last step
    lr_at(0, peak=1e-3, steps=100, warmup_steps=10, schedule="cosine_restarts", cycles=3)  # 0.0: transformers'
    lr_for_config(step, cfg)                                              # with a RunConfig's fields

Two families:
- labkit's own ("constant", "linear", "cosine"): warmup reaches peak * (step + 1) / warmup_steps at step `step`,
  so step 0 already trains; the decay ends at min_lr_ratio * peak on the last step.
- transformers' ("cosine_restarts": get_cosine_with_hard_restarts_schedule_with_warmup, "polynomial":
  get_polynomial_decay_schedule_with_warmup). labkit builds transformers' own LambdaLR once, on a stand-in
  optimizer, and takes the multiplier function it holds: the LR at step s is peak * multiplier(s), exactly what
  that LambdaLR gives the optimizer's s-th step. transformers' warmup starts at 0 (step 0 does not move the
  weights) and its restarts decay to 0 whatever min_lr_ratio says (RunConfig rejects a floor there).
"plateau" is not a function of the step (it follows the held-out loss): training/plateau.py keeps its state and
hands its current LR in as `peak`; warmup applies to it like to "constant".
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

from ..config import RunConfig

OWN = ("constant", "linear", "cosine")
TRANSFORMERS = ("cosine_restarts", "polynomial")


def lr_at(step: int, *, peak: float, steps: int, warmup_steps: int = 0, schedule: str = "constant",
          min_lr_ratio: float = 0.0, cycles: int = 1, power: float = 1.0) -> float:
    """The learning rate used at optimizer step `step` (0-based)."""
    if schedule in TRANSFORMERS:
        return peak * transformers_multiplier(schedule, peak=peak, steps=steps, warmup_steps=warmup_steps,
                                              min_lr_ratio=min_lr_ratio, cycles=cycles, power=power)(step)
    # 1) linear warmup: step 0 already trains, at peak/warmup, reaching peak after warmup_steps steps
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    # 2) after warmup, progress runs from 0 (first step after warmup) to 1 (the last step)
    decay_steps = steps - warmup_steps - 1
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    floor = peak * min_lr_ratio
    # 3) the shape of the decay from peak down to the floor
    if schedule in ("constant", "plateau"):
        return peak
    if schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule = {schedule!r}: must be one of {', '.join(OWN + TRANSFORMERS)} (or plateau, "
                     "whose LR comes from training/plateau.py)")


@lru_cache(maxsize=64)
def transformers_multiplier(schedule: str, *, peak: float, steps: int, warmup_steps: int, min_lr_ratio: float = 0.0,
                            cycles: int = 1, power: float = 1.0) -> Callable[[int], float]:
    """The step -> LR multiplier inside transformers' own LambdaLR for `schedule` (a pure function of the step):
    transformers_multiplier("cosine_restarts", peak=1e-3, steps=100, warmup_steps=10, cycles=3)(50)."""
    import torch
    from transformers import (get_cosine_with_hard_restarts_schedule_with_warmup,
                              get_polynomial_decay_schedule_with_warmup)
    # LambdaLR multiplies the optimizer's initial LR; polynomial reads it to turn its absolute end LR into a ratio.
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    if schedule == "cosine_restarts":
        scheduler = get_cosine_with_hard_restarts_schedule_with_warmup(stand_in, warmup_steps, steps, num_cycles=cycles)
    elif schedule == "polynomial":
        scheduler = get_polynomial_decay_schedule_with_warmup(stand_in, warmup_steps, steps,
                                                              lr_end=peak * min_lr_ratio, power=power)
    else:
        raise ValueError(f"schedule = {schedule!r}: transformers' schedules here are {', '.join(TRANSFORMERS)}")
    return scheduler.lr_lambdas[0]


def lr_for_config(step: int, config: RunConfig, peak: float | None = None) -> float:
    """lr_at with the schedule fields of a RunConfig:  lr_for_config(step, cfg). `peak` replaces config.lr (the
    plateau scheduler's current LR)."""
    return lr_at(step, peak=config.lr if peak is None else peak, steps=config.steps,
                 warmup_steps=config.warmup_steps, schedule=config.schedule, min_lr_ratio=config.min_lr_ratio,
                 cycles=config.cycles, power=config.poly_power)
