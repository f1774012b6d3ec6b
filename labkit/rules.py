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

# The choices RunConfig's fields offer (config.py re-exports them).
TASKS = ("tinylm", "digits", "tinymoe")
MODEL_SIZES = ("tiny", "small", "base")
LAYERS = {"tinylm": {"tiny": 2, "small": 4, "base": 6}, "tinymoe": {"tiny": 2, "small": 2, "base": 4}}
"""Transformer blocks (decoder layers) of each task's model sizes, when RunConfig.layers is 0 (RunConfig.blocks)."""
LM_HEADS = {"tiny": 4, "small": 4, "base": 8}
"""tinylm's attention heads per model size (training/tasks.py builds the model with them)."""
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "linear", "cosine", "cosine_restarts", "polynomial", "plateau")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # fp8: simulated, training/fp8*.py
BACKENDS = ("auto", "gloo", "nccl", "mpi")
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp", "fsdp+tp", "pp")  # labkit/training/parallel/strategies.py says what each is
TP_STRATEGIES = ("tp", "fsdp+tp")
TP_DEGREES = (1, 2, 4)  # divide the attention heads of every tinylm size (4, 4, 8)
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")
NAN_POLICIES = ("raise", "alone", "stop", "skip", "ignore")
CHECKPOINT_FORMATS = ("auto", "full", "dcp")
BALANCING = ("none", "aux", "bias", "bias_per_rank")  # tinymoe: how expert load is balanced (training/routing.py)
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                      "DualPipeV")  # torch.distributed.pipelining's names (training/parallel/pipeline.py)
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
PIPELINE_SHAPES = ("inferred", "fixed", "fixed_no_grad")
FP8_SCALINGS = ("tensor", "row", "tile")  # per tensor, per row (torchao's rowwise), V3's tiles and blocks (training/fp8_linear.py)
FP8_ENGINES = ("labkit", "torchao")  # who computes the nn.Linear layers' FP8 matmuls (training/fp8_layers.py)
FP8_FORMATS = ("e4m3", "e5m2")
CONTEXT_METHODS = ("ring", "allgather", "ulysses")  # how attention sees the whole sequence (training/parallel/context.py)
CONTEXT_SPLITS = ("contiguous", "zigzag")  # which positions each context-parallel rank holds
RECOMPUTE = ("none", "full")  # activation recomputation per transformer block (training/parallel/recompute.py)


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


RULES: dict[str, Rule] = {
    "task": one_of(*TASKS), "model_size": one_of(*MODEL_SIZES), "world_size": integer(1),
    "global_batch": integer(1), "grad_accum": integer(1), "no_sync": boolean, "steps": integer(1),
    "optimizer": one_of(*OPTIMIZERS), "lr": number(0.0, inclusive=False), "weight_decay": number(0.0),
    "momentum": number(0.0), "schedule": one_of(*SCHEDULES), "warmup_steps": integer(0),
    "min_lr_ratio": number(0.0, high=1.0), "cycles": integer(1), "poly_power": number(0.0, inclusive=False),
    "plateau_patience": integer(0), "plateau_factor": number(0.0, inclusive=False, high=1.0),
    "plateau_per_rank": boolean,
    "clip_norm": optional(number(0.0, inclusive=False), "no clipping"),
    "precision": one_of(*PRECISIONS), "seed": integer(0), "deterministic": boolean, "backend": one_of(*BACKENDS),
    "strategy": one_of(*STRATEGIES), "bucket_cap_mb": number(0.0, inclusive=False), "comm_hook": one_of(*COMM_HOOKS),
    "powersgd_rank": integer(1), "memory_budget_mb": optional(number(0.0, inclusive=False), "no budget"),
    "data_workers": integer(0), "sample_cost_ms": number(0.0), "pin_memory": boolean, "persistent_workers": boolean,
    "prefetch_factor": integer(1), "seq_len": integer(2), "vocab_size": integer(2), "branching": integer(1),
    "eval_every": integer(0), "nan_policy": one_of(*NAN_POLICIES), "tensorboard": boolean, "save_final": boolean, "name": text,
    "checkpoint_every": integer(0), "checkpoint_keep": integer(1), "checkpoint_format": one_of(*CHECKPOINT_FORMATS),
    "dropout": number(0.0, high=0.9), "languages": integer(1), "language_skew": number(0.0), "experts": integer(2),
    "top_k": integer(1), "expert_groups": integer(1), "group_top_k": integer(1), "balancing": one_of(*BALANCING),
    "aux_alpha": number(0.0, inclusive=False), "bias_gamma": number(0.0, inclusive=False),
    "capacity_factor": optional(number(0.0, inclusive=False), "no dropping"), "expert_parallel": integer(1),
    "broadcast_buffers": boolean,
    "layers": integer(0), "pipeline_ranks": integer(0), "microbatches": integer(1),
    "pipeline_schedule": one_of(*PIPELINE_SCHEDULES), "stages_per_rank": integer(1),
    "pipeline_shapes": one_of(*PIPELINE_SHAPES), "pipeline_check": boolean,
    "profile_step": optional(integer(0), "no profiler"),
    "fp8_scaling": one_of(*FP8_SCALINGS), "fp8_tile": integer(0), "fp8_grad_format": one_of(*FP8_FORMATS),
    "fp8_dispatch": boolean, "fp8_engine": one_of(*FP8_ENGINES), "pipeline_zero1": boolean, "sequence_parallel": boolean,
    "context_parallel": integer(1), "tensor_parallel": integer(1), "context_method": one_of(*CONTEXT_METHODS), "context_split": one_of(*CONTEXT_SPLITS),
    "recompute": one_of(*RECOMPUTE),
}
"""The rule each RunConfig field's value must pass; faults are checked by their own shape and ranges (fault.py)."""
