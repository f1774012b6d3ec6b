"""One ipywidgets control per RunConfig field, and back: the knobs of the control panel (panel.py).

    knobs = make_knobs(cfg, ["world_size", "lr", "clip_norm", "faults"])
    knobs["lr"].widget.value = 0.01                # what a person does with the slider
    knobs["clip_norm"].value                       # the value for the config: None while the menu says "off"
    new_cfg = config_from(cfg, knobs)              # cfg.replace(world_size=..., lr=...): ConfigError if invalid

Each Knob holds the widget a person moves (`knob.widget`) and turns its state into the field's value and back
(`knob.value`). Menus offer the values worth trying for a field (and always the config's own value); fields
without a menu of their own get a box of their type. `faults` is one fault to inject: a kind ("none" for no
fault), the rank, the step, and the delay of a "slow" fault.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ..config import (BACKENDS, BALANCING, CHECKPOINT_FORMATS, COMM_HOOKS, FP8_ENGINES, FP8_FORMATS, FP8_SCALINGS, MODEL_SIZES,
                      NAN_POLICIES, OPTIMIZERS, PIPELINE_SCHEDULES, PIPELINE_SHAPES, PRECISIONS,
                      SCHEDULES, STRATEGIES, TASKS, RunConfig)
from ..fault import DELAYED, FAULT_KINDS, Fault
from ..rules import RECOMPUTE

LABEL_WIDTH = "120px"
OFF = "off"  # the menu entry that stands for None (no clipping, no memory budget)


class Knob:
    """A RunConfig field's control: `widget` is shown; `value` reads and writes it in the field's own terms."""

    def __init__(self, field: str, widget: Any, read: Callable[[Any], Any] = lambda v: v,
                 write: Callable[[Any], Any] = lambda v: v):
        self.field, self.widget, self._read, self._write = field, widget, read, write

    @property
    def value(self) -> Any:
        return self._read(self.widget.value)

    @value.setter
    def value(self, value: Any) -> None:
        self.widget.value = self._write(value)


def _style() -> dict[str, Any]:
    import ipywidgets
    return {"style": {"description_width": LABEL_WIDTH}, "layout": ipywidgets.Layout(width="340px")}


def menu(*options: Any) -> Callable[[str, Any], Knob]:
    """A drop-down of `options` (and the current value, if it is not among them)."""
    def make(field: str, value: Any) -> Knob:
        import ipywidgets
        choices = list(options) + ([value] if value not in options else [])
        return Knob(field, ipywidgets.Dropdown(options=choices, value=value, description=field, **_style()))
    return make


def optional_menu(*options: float) -> Callable[[str, Any], Knob]:
    """A drop-down of numbers and "off" (None)."""
    def make(field: str, value: Any) -> Knob:
        import ipywidgets
        numbers = list(options) + ([value] if value is not None and value not in options else [])
        widget = ipywidgets.Dropdown(options=[OFF, *numbers], value=OFF if value is None else value,
                                     description=field, **_style())
        return Knob(field, widget, read=lambda v: None if v == OFF else v, write=lambda v: OFF if v is None else v)
    return make


def slider(low: int, high: int, step: int = 1) -> Callable[[str, Any], Knob]:
    """An integer slider from `low` to `high` (widened to hold the current value)."""
    def make(field: str, value: Any) -> Knob:
        import ipywidgets
        return Knob(field, ipywidgets.IntSlider(value=value, min=min(low, value), max=max(high, value), step=step,
                                                description=field, continuous_update=False, **_style()))
    return make


def float_slider(low: float, high: float, step: float) -> Callable[[str, Any], Knob]:
    def make(field: str, value: Any) -> Knob:
        import ipywidgets
        return Knob(field, ipywidgets.FloatSlider(value=value, min=min(low, value), max=max(high, value), step=step,
                                                  description=field, continuous_update=False, **_style()))
    return make


def log_slider(low: float, high: float) -> Callable[[str, Any], Knob]:
    """A slider over powers of ten (learning rates), a tenth of a decade per notch."""
    def make(field: str, value: Any) -> Knob:
        import ipywidgets
        lo, hi = math.floor(math.log10(min(low, value))), math.ceil(math.log10(max(high, value)))
        return Knob(field, ipywidgets.FloatLogSlider(value=value, base=10, min=lo, max=hi, step=0.1,
                                                     readout_format=".1e", description=field,
                                                     continuous_update=False, **_style()))
    return make


def by_type(field: str, value: Any) -> Knob:
    """A box of the value's type, for a field without a control of its own."""
    import ipywidgets
    kind = (ipywidgets.Checkbox if isinstance(value, bool) else ipywidgets.IntText if isinstance(value, int)
            else ipywidgets.FloatText if isinstance(value, float) else ipywidgets.Text)
    return Knob(field, kind(value=value, description=field, **_style()))


class FaultKnob(Knob):
    """One fault to inject, or none: kind, rank, step (and delay_s for "slow")."""

    def __init__(self, field: str, value: tuple[Fault, ...]):
        import ipywidgets
        first = value[0] if value else Fault(kind="raise", rank=0, step=0)
        small = {"style": {"description_width": "40px"}, "layout": ipywidgets.Layout(width="110px")}
        self.kind = ipywidgets.Dropdown(options=["none", *FAULT_KINDS], value=first.kind if value else "none",
                                        description=field, **_style())
        self.rank = ipywidgets.BoundedIntText(value=first.rank, min=0, max=1023, description="rank", **small)
        self.step = ipywidgets.BoundedIntText(value=first.step, min=0, max=10**6, description="step", **small)
        self.delay = ipywidgets.FloatText(value=first.delay_s or 0.02, description="delay", **small)
        super().__init__(field, ipywidgets.HBox([self.kind, self.rank, self.step, self.delay]))

    @property
    def value(self) -> tuple[Fault, ...]:
        if self.kind.value == "none":
            return ()
        delay = self.delay.value if self.kind.value in DELAYED else 0.0
        return (Fault(kind=self.kind.value, rank=self.rank.value, step=self.step.value, delay_s=delay),)

    @value.setter
    def value(self, value: tuple[Fault, ...]) -> None:
        self.kind.value = value[0].kind if value else "none"
        if value:
            self.rank.value, self.step.value = value[0].rank, value[0].step
            self.delay.value = value[0].delay_s or self.delay.value


CONTROLS: dict[str, Callable[[str, Any], Knob]] = {
    "task": menu(*TASKS), "model_size": menu(*MODEL_SIZES), "world_size": slider(1, 8),
    "global_batch": menu(8, 16, 32, 64, 128, 256), "grad_accum": menu(1, 2, 4, 8), "steps": slider(5, 300, 5),
    "optimizer": menu(*OPTIMIZERS), "lr": log_slider(1e-4, 1.0), "schedule": menu(*SCHEDULES),
    "warmup_steps": slider(0, 100), "min_lr_ratio": float_slider(0.0, 1.0, 0.05), "cycles": slider(1, 5),
    "clip_norm": optional_menu(0.1, 0.5, 1.0, 2.0, 5.0), "precision": menu(*PRECISIONS),
    "backend": menu(*BACKENDS), "strategy": menu(*STRATEGIES), "comm_hook": menu(*COMM_HOOKS),
    "bucket_cap_mb": menu(0.001, 0.01, 0.1, 1.0, 25.0, 100.0), "powersgd_rank": slider(1, 8),
    "memory_budget_mb": optional_menu(25.0, 50.0, 100.0, 200.0, 400.0), "data_workers": slider(0, 4),
    "sample_cost_ms": float_slider(0.0, 5.0, 0.25), "prefetch_factor": slider(1, 8), "eval_every": slider(0, 50),
    "nan_policy": menu(*NAN_POLICIES), "plateau_patience": slider(0, 10),
    "plateau_factor": float_slider(0.1, 0.9, 0.1), "checkpoint_every": slider(0, 50),
    "checkpoint_format": menu(*CHECKPOINT_FORMATS), "faults": FaultKnob,
    "balancing": menu(*BALANCING), "bias_gamma": log_slider(1e-4, 0.1), "aux_alpha": log_slider(1e-4, 1.0),
    "capacity_factor": optional_menu(0.5, 1.0, 1.25, 1.5, 2.0), "experts": menu(4, 8, 16), "top_k": slider(1, 4),
    "expert_parallel": menu(1, 2, 4), "expert_groups": menu(1, 2, 4), "language_skew": float_slider(0.0, 3.0, 0.25),
    "pipeline_schedule": menu(*PIPELINE_SCHEDULES), "microbatches": menu(1, 2, 4, 8, 16), "stages_per_rank": slider(1, 4),
    "pipeline_ranks": menu(0, 2, 4), "layers": menu(0, 2, 4, 8), "pipeline_shapes": menu(*PIPELINE_SHAPES),
    "fp8_scaling": menu(*FP8_SCALINGS), "fp8_tile": menu(0, 1, 4, 8, 16, 32, 128),
    "fp8_grad_format": menu(*FP8_FORMATS), "fp8_engine": menu(*FP8_ENGINES), "recompute": menu(*RECOMPUTE),
}
"""How each field is controlled; any other field gets a box of its type (by_type)."""


def make_knobs(config: RunConfig, fields: Sequence[str]) -> dict[str, Knob]:
    """A Knob per field, set to `config`'s values; an unknown field name is refused, naming the known ones."""
    known = set(config.to_dict())
    unknown = [f for f in fields if f not in known]
    if unknown:
        raise ValueError(f"no RunConfig field(s) {unknown}: pick from {sorted(known)}")
    return {f: CONTROLS.get(f, by_type)(f, getattr(config, f)) for f in fields}


def config_from(base: RunConfig, knobs: dict[str, Knob]) -> RunConfig:
    """`base` with every knob's value: a validated RunConfig (ConfigError names every field that is not allowed)."""
    return base.replace(**{field: knob.value for field, knob in knobs.items()})


def describe(config: RunConfig, base: RunConfig) -> str:
    """What differs from `base`, short:  "world_size=1, lr=0.01" (or "as given" when nothing does)."""
    changed = [f"{field}={_short(getattr(config, field))}" for field in config.__dataclass_fields__
               if field != "name" and getattr(config, field) != getattr(base, field)]
    return ", ".join(changed) or "as given"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, tuple):
        return "+".join(f"{f.kind}@r{f.rank}s{f.step}" for f in value) or "none"
    return str(value)
