"""The run configuration: one frozen, validated dataclass per training run.

    from labkit import RunConfig
    cfg = RunConfig(task="tinylm", world_size=2, global_batch=32, steps=40, lr=3e-3)
    cfg = RunConfig.per_rank(batch_per_rank=16, world_size=2)   # same thing, from the per-rank side
    cfg2 = cfg.replace(world_size=1)                            # a validated copy

A bad value is rejected when the config is built, before any process starts, with a message that names
the field, the value and what is allowed (`ConfigError`, a `ValueError`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fault import Fault, as_faults, fault_shape
from .rules import Rule, boolean, integer, is_int, is_number, number, one_of, optional, shown, text

TASKS = ("tinylm", "digits")
MODEL_SIZES = ("tiny", "small", "base")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "linear", "cosine", "cosine_restarts", "polynomial", "plateau")
PRECISIONS = ("fp32", "bf16", "fp16")
BACKENDS = ("auto", "gloo", "nccl", "mpi")
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp", "fsdp+tp")  # labkit/training/strategies.py says what each is
TP_STRATEGIES = ("tp", "fsdp+tp")
TP_DEGREES = (1, 2, 4)  # divide the attention heads of every tinylm size (4, 4, 8)
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")
NAN_POLICIES = ("raise", "alone", "stop", "skip", "ignore")
CHECKPOINT_FORMATS = ("auto", "full", "dcp")


class ConfigError(ValueError):
    """A RunConfig (or Fault) field holds a value that is not allowed; the message lists every such field."""


def quick_mode() -> bool:
    """True when LABKIT_QUICK=1 (set by `make test`): lessons run the same cells with smaller sizes."""
    return os.environ.get("LABKIT_QUICK", "") not in ("", "0", "false", "False")


def pick(full: Any, quick: Any) -> Any:
    """Return `quick` in quick mode, else `full`:  steps = pick(full=200, quick=30)."""
    return quick if quick_mode() else full


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that defines one training run. Frozen: derive variants with `cfg.replace(...)`."""

    task: str = "tinylm"
    """"tinylm": a tiny GPT-2 on synthetic text with a known loss floor; "digits": an MLP on sklearn's 8x8 digits."""
    model_size: str = "tiny"
    """"tiny" | "small" | "base": width and depth of the task's model."""
    world_size: int = 2
    """Number of ranks (processes). Above the core count, ranks share cores: results are labelled oversubscribed."""
    global_batch: int = 32
    """Samples per optimizer step, over all ranks and accumulation steps; must split evenly (see batch_per_rank)."""
    grad_accum: int = 1
    """Micro-batches accumulated before each optimizer step."""
    no_sync: bool = True
    """With grad_accum > 1: skip DDP's all-reduce on all micro-batches but the last (DDP.no_sync). False is the
    naive way: every micro-batch's backward all-reduces, grad_accum times the traffic for the same update."""
    steps: int = 20
    """Optimizer steps."""
    optimizer: str = "adamw"
    """"sgd" | "adam" | "adamw"."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    momentum: float = 0.9
    """SGD momentum (ignored by Adam/AdamW)."""
    schedule: str = "constant"
    """Shape of the LR after warmup: "constant" | "linear" | "cosine" (decay to min_lr_ratio * lr at the last step);
    transformers' own "cosine_restarts" (cosine with hard restarts and warmup, `cycles`) | "polynomial"
    (`poly_power`, down to min_lr_ratio * lr); "plateau": torch's ReduceLROnPlateau on the held-out loss, measured
    every eval_every steps and all-reduced over ranks (training/schedule.py, training/plateau.py)."""
    warmup_steps: int = 0
    """Linear warmup from lr/warmup_steps up to lr over this many steps (transformers' schedules start from 0)."""
    min_lr_ratio: float = 0.0
    """Floor of the decaying schedules, as a fraction of lr (plateau: the lowest LR it cuts down to)."""
    cycles: int = 1
    """cosine_restarts: cosine cycles after warmup (transformers' num_cycles); each one restarts at the peak."""
    poly_power: float = 1.0
    """polynomial: the exponent of the decay (transformers' power; 1.0 is linear)."""
    plateau_patience: int = 2
    """plateau: held-out evaluations without improvement before the LR is cut."""
    plateau_factor: float = 0.5
    """plateau: what each cut multiplies the LR by."""
    plateau_per_rank: bool = False
    """plateau: feed each rank its own shard's held-out loss instead of the all-reduced one. The classic bug: the
    ranks' schedulers then cut at different steps, and the ranks train with different LRs (Run.lr_disagreement)."""
    clip_norm: float | None = None
    """Clip the global gradient norm to this value; None records the norm without clipping."""
    precision: str = "fp32"
    """"fp32" | "bf16" | "fp16" (autocast; fp16 also uses a GradScaler)."""
    seed: int = 0
    """Seeds model init and the data stream; equal on every rank."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) (and cuDNN/cuBLAS settings on GPUs): see labkit.seeding."""
    backend: str = "auto"
    """"auto" picks nccl when CUDA is available for every rank, else gloo."""
    strategy: str = "ddp"
    """How the model is spread over the ranks: "ddp" (every rank holds everything), "zero1" (optimizer state
    sharded: ZeroRedundancyOptimizer), "zero2" (and gradients: FSDP2 without resharding after forward), "fsdp"
    (and parameters: FSDP2, ZeRO-3), "tp" (each block's matrices split over all ranks; tinylm), "fsdp+tp"
    (a 2-D mesh: world_size/2 FSDP ranks x 2 tensor-parallel; tinylm, world_size 4, 6, ...). See parallel_dims."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size."""
    comm_hook: str = "allreduce"
    """How DDP sends gradients: "allreduce" (plain), "fp16" / "bf16" (compressed to 16 bits on the wire),
    "powersgd" (low-rank, powersgd_rank). Whatever the hook, labkit records per step the collectives each rank
    really issued and the bytes of the tensors it handed them (allreduces, comm_bytes)."""
    powersgd_rank: int = 1
    """PowerSGD's matrix approximation rank."""
    memory_budget_mb: float | None = None
    """Fail like an out-of-memory error when a rank's peak memory grows by more than this over its baseline
    (CPU: resident memory). None: no budget (on GPUs, real CUDA OOMs are reported the same way)."""
    data_workers: int = 0
    """digits: DataLoader worker processes; with 0 and sample_cost_ms 0 batches are sliced directly in memory."""
    sample_cost_ms: float = 0.0
    """digits: real CPU work per sample (decoding/augmentation stand-in), done by the DataLoader pipeline."""
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int = 2
    """Batches each DataLoader worker prepares ahead."""
    checkpoint_every: int = 0
    """Save a checkpoint under runs/<id>/checkpoints/ after every this many steps (0: never): model, optimizer,
    GradScaler and plateau state, every rank's RNG streams, the data position and the step, written atomically
    (training/checkpoint.py). A run that finds a checkpoint in its directory resumes from it: launch(...,
    resume_from=...) and launch(..., max_restarts=N) rely on that, and so does torchrun --max-restarts."""
    checkpoint_keep: int = 2
    """How many of the newest checkpoints to keep (older ones are deleted once a newer one is complete)."""
    checkpoint_format: str = "auto"
    """How model and optimizer state are written: "full" (one file, written by rank 0: every rank holds all of
    it, as under DDP), "dcp" (torch.distributed.checkpoint: each rank writes what it holds; what sharded
    strategies need), "auto" (full for replicated strategies, dcp for sharded ones)."""
    dropout: float = 0.0
    """tinylm: dropout probability of GPT-2's embeddings, attention and residual paths. Dropout masks come from
    each rank's torch generator: state that a checkpoint must carry for a resumed run to match an uninterrupted one."""
    seq_len: int = 32
    """tinylm: tokens per sample."""
    vocab_size: int = 64
    """tinylm: vocabulary of the synthetic language."""
    branching: int = 4
    """tinylm: each token is followed by one of this many tokens, uniformly: the loss floor is ln(branching)."""
    eval_every: int = 0
    """Evaluate every this many steps (0: never): digits' held-out accuracy; with schedule="plateau", the held-out
    loss that drives it (any task)."""
    nan_policy: str = "raise"
    """What a non-finite loss (or gradient) does (training/stability.py):
    "raise": the rank that sees it raises NonFiniteLoss; the launcher then stops the others (no collective);
    "alone": that rank leaves its loop quietly, as a hand-written `if isnan(loss): break` does; its peers wait in
        their next collective until the watchdog (launch's timeout) reports a hang;
    "stop": one all-reduced flag per step; every rank stops at the same step, and the failure names the rank that
        went non-finite first and the first parameter whose gradient was not finite;
    "skip": the same flag; every rank skips that optimizer step, and records it (skipped_step, nonfinite_ranks);
    "ignore": no check: NaNs flow through the gradient average into every rank."""
    faults: tuple[Fault, ...] = ()
    """Failures to inject on purpose, for lessons and tests."""
    tensorboard: bool = True
    """Also write TensorBoard events under runs/<id>/tb/rank<r>/ (made from the records when the run ends)."""
    save_final: bool = True
    """Save each rank's final parameters to runs/<id>/final/rank<r>.pt."""
    name: str = ""
    """A label for plots and the run directory; empty: derived from the config."""

    def __post_init__(self) -> None:
        # JSON and notebooks hand us lists of dicts; keep the dataclass hashable and typed. What cannot be turned
        # into Faults is left as it is, for problems() to report with the field's name.
        object.__setattr__(self, "faults", as_faults(self.faults))
        self.validate()

    @classmethod
    def per_rank(cls, *, batch_per_rank: int, **fields: Any) -> "RunConfig":
        """Build from the per-rank side:  RunConfig.per_rank(batch_per_rank=16, world_size=4, grad_accum=2)."""
        world = fields.get("world_size", cls.world_size)
        accum = fields.get("grad_accum", cls.grad_accum)
        return cls(global_batch=batch_per_rank * world * accum, **fields)

    @property
    def batch_per_rank(self) -> int:
        """Samples in one micro-batch on one rank: global_batch / (world_size * grad_accum)."""
        return self.global_batch // (self.world_size * self.grad_accum)

    @property
    def parallel_dims(self) -> tuple[int, int]:
        """(data-parallel ranks, tensor-parallel ranks); their product is world_size:  (2, 2) for "fsdp+tp" on 4."""
        tp = {"tp": self.world_size, "fsdp+tp": 2}.get(self.strategy, 1)
        return self.world_size // tp, tp

    @property
    def loss_floor(self) -> float | None:
        """The lowest loss any model can reach on this task, when it is known: ln(branching) for tinylm."""
        return math.log(self.branching) if self.task == "tinylm" else None

    @property
    def label(self) -> str:
        return self.name or f"{self.task} w{self.world_size} b{self.batch_per_rank}x{self.grad_accum}"

    def replace(self, **changes: Any) -> "RunConfig":
        """A validated copy with some fields changed:  cfg.replace(world_size=1)."""
        return dataclasses.replace(self, **changes)

    def problems(self) -> list[str]:
        """Every field that holds a value that is not allowed, as a sentence; empty when the config is valid."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            why = fault_shape(value) if f.name == "faults" else RULES[f.name](value)
            if why:
                out.append(f"RunConfig.{f.name} = {shown(value)}: {why}")
        if out:
            return out  # the rules below compare fields, which only makes sense once each field is valid
        if self.task != "digits":
            for name in ("data_workers", "sample_cost_ms"):
                if getattr(self, name):
                    out.append(f"RunConfig.{name} = {getattr(self, name)!r}: the DataLoader pipeline exists for task "
                               f"'digits' only (RunConfig.task = {self.task!r}); leave it at 0")
        if self.dropout and self.task != "tinylm":
            out.append(f"RunConfig.dropout = {self.dropout!r}: dropout exists for task 'tinylm' only "
                       f"(RunConfig.task = {self.task!r}); leave it at 0")
        if self.branching > self.vocab_size:
            out.append(f"RunConfig.branching = {self.branching}: must be at most RunConfig.vocab_size = "
                       f"{self.vocab_size}")
        out += self._batch_problems() + self._schedule_problems() + self._strategy_problems()
        for i, fault in enumerate(self.faults):
            out += [f"RunConfig.faults[{i}]: {why} (RunConfig.world_size = {self.world_size}, RunConfig.steps = "
                    f"{self.steps})" for why in fault.problems(self.world_size, self.steps)]
        return out

    def _batch_problems(self) -> list[str]:
        split = self.world_size * self.grad_accum
        if self.global_batch % split:
            lower = max(split, self.global_batch // split * split)
            return [f"RunConfig.global_batch = {self.global_batch}: does not split evenly over RunConfig.world_size="
                    f"{self.world_size} x RunConfig.grad_accum={self.grad_accum} = {split}; use a multiple of "
                    f"{split}, e.g. {lower} or {lower + split}"]
        return []

    def _schedule_problems(self) -> list[str]:
        where = f"RunConfig.schedule = {self.schedule!r}"
        if self.schedule == "plateau" and not self.eval_every:
            return [f"{where} needs a held-out loss: set RunConfig.eval_every to how often to measure it, e.g. 5"]
        if self.schedule == "plateau" and self.plateau_factor >= 1.0:
            return [f"{where}: RunConfig.plateau_factor = {self.plateau_factor!r} must be below 1 (each cut "
                    "multiplies the LR by it; torch's ReduceLROnPlateau refuses 1)"]
        if self.schedule == "cosine_restarts" and self.min_lr_ratio:
            return [f"{where}: transformers' restarts decay to 0; RunConfig.min_lr_ratio = {self.min_lr_ratio!r} "
                    "must be 0 (or use 'cosine', which has a floor)"]
        if self.schedule == "polynomial" and self.min_lr_ratio >= 1.0:
            return [f"{where}: decays from lr to min_lr_ratio * lr, so RunConfig.min_lr_ratio = "
                    f"{self.min_lr_ratio!r} must be below 1"]
        return []

    def _strategy_problems(self) -> list[str]:
        """What the chosen strategy cannot do with the other fields (mesh shape, task, precision, comm hook)."""
        if self.strategy == "ddp":
            return []
        out, field = [], f"RunConfig.strategy = {self.strategy!r}"
        tp = self.parallel_dims[1]
        if self.strategy == "fsdp+tp" and (self.world_size < 4 or self.world_size % 2):
            out.append(f"{field}: its mesh is (world_size/2 data-parallel x 2 tensor-parallel) ranks, so "
                       f"RunConfig.world_size = {self.world_size} must be even and at least 4; use 4")
        if self.strategy == "tp" and tp not in TP_DEGREES:
            out.append(f"{field}: splits each block over all RunConfig.world_size = {self.world_size} ranks, which "
                       f"must divide the attention heads: use world_size {' or '.join(map(str, TP_DEGREES))}")
        if self.strategy in TP_STRATEGIES and self.task != "tinylm":
            out.append(f"{field}: tensor parallelism splits GPT-2 blocks, so RunConfig.task must be 'tinylm' "
                       f"(not {self.task!r}); use strategy 'fsdp' or 'zero1' for other models")
        if self.precision == "fp16":
            out.append(f"{field}: RunConfig.precision = 'fp16' (a GradScaler over sharded gradients) is not "
                       "supported here; use 'bf16' or 'fp32', or strategy 'ddp'")
        if self.strategy != "zero1" and self.comm_hook != "allreduce":
            out.append(f"{field}: RunConfig.comm_hook = {self.comm_hook!r} is a DDP comm hook; only 'ddp' and "
                       "'zero1' use DDP: leave comm_hook at 'allreduce'")
        return out

    def validate(self) -> "RunConfig":
        """Raise ConfigError listing every bad field; return self when all are valid."""
        problems = self.problems()
        if problems:
            raise ConfigError("invalid RunConfig:\n  " + "\n  ".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        """The config a dict describes (RunConfig.to_dict, or JSON): RunConfig.from_dict({"world_size": 4})."""
        if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
            raise ConfigError(f"RunConfig.from_dict({shown(data)}): pass a dict of field names to values")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown RunConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: Path) -> "RunConfig":
        """Read a config file a person wrote (RunConfig.save writes one); records.Run.config reads recorded ones."""
        return cls.from_dict(json.loads(Path(path).read_text()))


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
    "dropout": number(0.0, high=0.9),
}
"""The rule each field's value must pass (labkit.rules); faults are checked by their own shape and ranges."""
