"""The run configuration: one frozen, validated dataclass per training run.

    from labkit import RunConfig
    cfg = RunConfig(task="tinylm", world_size=2, global_batch=32, steps=40, lr=3e-3)
    cfg = RunConfig.per_rank(batch_per_rank=16, world_size=2)   # same thing, from the per-rank side
    cfg2 = cfg.replace(world_size=1)                            # a validated copy

A bad value is rejected before any process starts, with a message naming the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import constraints
from .dims import ParallelDims
from .fault import Fault, as_faults, fault_shape
from .modes import pick, quick_mode  # noqa: F401 - re-exported: labkit.config.pick is where lessons found it
from .rules import (  # noqa: F401 - the choices are re-exported (labkit.config.V_SCHEDULES): rules.py owns them
    BACKENDS, BALANCING, CHECKPOINT_FORMATS, CONTEXT_METHODS, CONTEXT_SPLITS, COMM_HOOKS, FP8_ENGINES, FP8_FORMATS, FP8_SCALINGS, LAYERS, MODEL_SIZES, NAN_POLICIES,
    OPTIMIZERS, PIPELINE_SCHEDULES, PIPELINE_SHAPES, PRECISIONS, SCHEDULES, SINGLE_STAGE_SCHEDULES, STRATEGIES, TASKS,
    RULES, TP_DEGREES, TP_STRATEGIES, V_SCHEDULES, shown)


class ConfigError(ValueError):
    """A RunConfig (or Fault) field holds a value that is not allowed; the message lists every such field."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that defines one training run. Frozen: derive variants with `cfg.replace(...)`."""

    task: str = "tinylm"
    """"tinylm": a tiny GPT-2 on synthetic text with a known loss floor; "digits": an MLP on sklearn's 8x8 digits;
    "tinymoe": a toy DeepSeek-V3 (transformers' MLA + mixture of experts) on a mixture of synthetic languages."""
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
    every eval_every steps and all-reduced over ranks (training/lr.py, training/plateau.py)."""
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
    """"fp32" | "bf16" | "fp16" (autocast; fp16 also uses a GradScaler) | "fp8" (matmuls in simulated FP8: fp8_*)."""
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
    (a 2-D mesh: world_size/2 FSDP ranks x 2 tensor-parallel; world_size 4, 6, ...), "pp" (the model cut into
    stages of blocks, one pipeline over pipeline_ranks ranks; world_size / pipeline_ranks data-parallel replicas
    of it). tinymoe: "ddp", "fsdp", "fsdp+tp", "pp" (constraints.MOE_STRATEGIES). See parallel_dims."""
    pipeline_ranks: int = 0
    """"pp": ranks in each pipeline; world_size / pipeline_ranks pipelines run as data-parallel replicas on a 2-D
    mesh (4 ranks, pipeline_ranks 2: 2 stages x 2 replicas). 0: every rank in one pipeline."""
    microbatches: int = 4
    """"pp": microbatches each pipeline step splits its replica's batch into (the pipeline's own accumulation)."""
    pipeline_schedule: str = "1F1B"
    """"pp": the order stages run their microbatches, by torch.distributed.pipelining's name: "GPipe", "1F1B"
    (one stage per rank); "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble" (stages_per_rank >= 2, looped);
    "ZBVZeroBubble", "DualPipeV" (exactly 2 stages per rank, in a V). Not `schedule`: that is the LR's."""
    stages_per_rank: int = 1
    """"pp": stages each rank holds (v): 1 for GPipe/1F1B, 2 for the V-shaped schedules, >= 2 for the looped ones."""
    pipeline_shapes: str = "inferred"
    """"pp": how stages learn the shapes they exchange: "inferred" (sent on the first step; needs numpy), "fixed"
    (example tensors given to every stage), "fixed_no_grad" (the trap: a later stage's example input without
    requires_grad; earlier stages then train on wrong gradients, silently)."""
    pipeline_check: bool = True
    """"pp": on the first step, compare every gradient with the unsplit model's on the same batch and raise
    PipelineGradientError naming the stage and parameter when they differ (catches "fixed_no_grad")."""
    profile_step: int | None = None
    """Run this step under torch.profiler on every rank (CPU activity, shapes recorded; CUDA's too on a GPU) and
    write each rank's Chrome trace JSON to runs/<id>/trace<rank>.json, for Perfetto or chrome://tracing
    (labkit.tricks.pipeline.read_stage_trace reads a pipeline step's). None: no profiler. The profiler slows the
    step it watches: leave that step out of timing claims."""
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
    (training/state/checkpoint.py). A run that finds a checkpoint in its directory resumes from it: launch(...,
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
    layers: int = 0
    """tinylm (tinymoe): transformer blocks (decoder layers); 0: the model_size's own (rules.LAYERS: tiny 2, small
    4, base 6; tinymoe 2, 2, 4). A pipeline of 4 stages needs a multiple of 4."""
    vocab_size: int = 64
    """tinylm: vocabulary of the synthetic language."""
    branching: int = 4
    """tinylm: each token is followed by one of this many tokens, uniformly: the loss floor is ln(branching)."""
    languages: int = 4
    """tinymoe: synthetic languages mixed, each on its own vocab_size / languages tokens (moe_task.py)."""
    language_skew: float = 0.0
    """tinymoe: language l is drawn with probability proportional to (l + 1) ** -language_skew (0: uniform)."""
    experts: int = 8
    """tinymoe: routed experts per MoE layer (DeepSeek-V3: 256), beside one shared expert."""
    top_k: int = 2
    """tinymoe: routed experts per token (DeepSeek-V3: 8)."""
    expert_groups: int = 2
    """tinymoe: groups of routed experts (transformers' n_group, at least 2 experts each; DeepSeek-V3: 8 nodes)."""
    group_top_k: int = 1
    """tinymoe: groups a token may use, chosen first (topk_group; DeepSeek-V3: 4, "at most 4 nodes")."""
    balancing: str = "none"
    """tinymoe: "none" | "aux" (aux_alpha x DeepSeek-V3's sequence-wise balance loss) | "bias" (its aux-loss-free
    bias, moved by bias_gamma after each step from loads summed over all ranks) | "bias_per_rank" (the bug: each
    rank's own loads). training/routing.py says what each trains."""
    aux_alpha: float = 0.01
    """tinymoe, balancing "aux": the balance loss's coefficient (DeepSeek-V3: 0.0001)."""
    bias_gamma: float = 0.01
    """tinymoe, balancing "bias"/"bias_per_rank": the bias update speed (DeepSeek-V3: 0.001)."""
    capacity_factor: float | None = None
    """tinymoe: None drops nothing (DeepSeek-V3). A number caps each expert at capacity_factor * tokens * top_k /
    experts assignments per micro-batch and rank; the rest are dropped in token order (GShard, Switch)."""
    expert_parallel: int = 1
    """tinymoe: ranks each layer's experts are split over, carved out of the data-parallel ranks: must divide
    world_size and experts (training/parallel/moe_layout.py)."""
    broadcast_buffers: bool = True
    """DDP's broadcast_buffers: copy rank 0's buffers (tinymoe: each router's e_score_correction_bias) to every rank
    at every forward."""
    eval_every: int = 0
    """Evaluate every this many steps (0: never): digits' held-out accuracy; with schedule="plateau", the held-out
    loss that drives it (any task)."""
    nan_policy: str = "raise"
    """What a non-finite loss (or gradient) does (training/nonfinite.py):
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
    fp8_scaling: str = "tile"
    """precision "fp8": "tensor" (one scale per tensor), "row" (torchao's rowwise: one per row along the summed
    dimension, powers of two) or "tile" (DeepSeek-V3's: 1 x fp8_tile tiles of activations and gradients along the
    summed dimension, fp8_tile x fp8_tile blocks of weights) (training/fp8_linear.py)."""
    fp8_tile: int = 0
    """precision "fp8", fp8_dispatch: the tile size t; 0: the model's width / 4, at least 8 (tinylm 16, tinymoe 8).
    V3's t = 128 is 1/56 of its 7168-wide rows; here a 1 x 128 tile would be a whole row and a 128 x 128 block a
    whole matrix, and "tile" would be per-tensor scaling in disguise."""
    fp8_grad_format: str = "e4m3"
    """precision "fp8": the gradients' format in backward: "e4m3" (V3) or "e5m2" (the older hybrid recipe)."""
    fp8_engine: str = "labkit"
    """precision "fp8": who computes the nn.Linear layers' matmuls. "labkit": its simulation (quantise, multiply in
    fp32); "torchao": torchao's Float8Linear (pip install 'labkit[fp8]'), through torch._scaled_mm, with fp8_scaling
    "tensor" (its tensorwise recipe) or "row" (rowwise); V3's "tile" needs a GPU there. tinymoe only (GPT-2's Conv1D
    is not an nn.Linear); the layers torchao cannot take (the routed experts) stay in labkit's simulation."""
    fp8_dispatch: bool = False
    """tinymoe, expert_parallel > 1: the dispatch all_to_all carries E4M3 values and 1 x fp8_tile scales, as V3's
    (training/fp8_wire.py); the combine and the gradients stay in the model's precision."""
    pipeline_zero1: bool = False
    """"pp": shard the optimizer state over each stage's data-parallel ranks (ZeRO-1, ZeroRedundancyOptimizer); with
    tinymoe and expert_parallel, DeepSeek-V3's PP x EP x ZeRO-1 (training/parallel/v3_layout.py)."""
    sequence_parallel: bool = False
    """"tp" / "fsdp+tp": also split the LayerNorms and the residual stream along the sequence (Korthikanti et al.
    2022): all-gathers and reduce-scatters in place of the all-reduces (training/parallel/tensor_parallel.py)."""
    tensor_parallel: int = 1
    """tinylm: ranks each block's matrices are split over (Megatron-LM's), composed with strategy "ddp" or "fsdp" (how
    the data-parallel ranks left hold the model) or "pp" (stages first: pipeline_ranks=2, tensor_parallel=2 on 4 ranks
    is 2 stages of 2 tensor-parallel ranks). Presets "tp" and "fsdp+tp" set their own: leave 1. See parallel_dims."""
    context_parallel: int = 1
    """tinylm: ranks each sequence is split over (context parallelism), carved out of the data-parallel ranks as
    expert parallelism is: world_size / context_parallel groups of neighbours each read one batch and hold a share
    of every sample's positions; attention sees the whole sequence by context_method (training/parallel/context.py)."""
    context_method: str = "ring"
    """context_parallel > 1: "ring" (K/V passed round the group, blocks merged by log-sum-exp), "allgather" (K/V
    gathered whole) or "ulysses" (all-to-all from sequence shards to head shards and back; heads divisible by
    context_parallel)."""
    context_split: str = "contiguous"
    """context_parallel > 1: "contiguous" (rank r: the r-th slice; the causal mask leaves the last rank the most
    work) or "zigzag" (rank r: chunks r and 2N-1-r of 2N, exactly even); seq_len must divide into N or 2N chunks."""
    recompute: str = "none"
    """tinylm: "full" keeps each GPT-2 block's input only, runs its forward again in backward (parallel/recompute.py)."""

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
        """Samples in one micro-batch on one rank: global_batch / (world_size * grad_accum); with context_parallel,
        the ranks of a group share theirs (each holds seq_len / context_parallel positions of every sample)."""
        return self.global_batch // (self.world_size // self.context_parallel * self.grad_accum)

    @property
    def parallel_dims(self) -> ParallelDims:
        """The degree of each parallelism (labkit/dims.py):  RunConfig(world_size=4, strategy="fsdp+tp").parallel_dims
        == ParallelDims(dp=2, tp=2, shard=True). Ranks the presets and degree fields leave over are data-parallel."""
        tp = {"tp": self.world_size, "fsdp+tp": 2}.get(self.strategy, self.tensor_parallel)
        cp = self.context_parallel
        pp = max(1, (self.pipeline_ranks or self.world_size // (tp * cp)) if self.strategy == "pp" else 1)
        dp = max(1, self.world_size // (tp * pp * cp))
        ep = self.expert_parallel if dp % self.expert_parallel == 0 else 1   # constraints report the misfit
        return ParallelDims(dp, tp, pp, cp, ep, shard=self.strategy in ("zero2", "fsdp", "fsdp+tp"))

    @property
    def pipeline_dims(self) -> tuple[int, int]:
        """"pp": (data-parallel replicas, ranks per pipeline), parallel_dims' (dp, pp):  (2, 2) on 4 ranks with
        pipeline_ranks=2. Other strategies: (world_size, 1)."""
        return (self.parallel_dims.dp, self.parallel_dims.pp) if self.strategy == "pp" else (self.world_size, 1)

    @property
    def blocks(self) -> int:
        """The model's transformer blocks (tinymoe: decoder layers): RunConfig.layers, or the model_size's own."""
        return self.layers or LAYERS.get(self.task, LAYERS["tinylm"])[self.model_size]

    @property
    def loss_floor(self) -> float | None:
        """The lowest loss any model can reach on this task, when it is known: ln(branching) for tinylm, tinymoe."""
        return math.log(self.branching) if self.task in ("tinylm", "tinymoe") else None

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
        if self.profile_step is not None and self.profile_step >= self.steps:
            out.append(f"RunConfig.profile_step = {self.profile_step}: the run has steps 0 to {self.steps - 1} "
                       f"(RunConfig.steps = {self.steps}); profile one of them, or None")
        if self.branching > self.vocab_size:
            out.append(f"RunConfig.branching = {self.branching}: must be at most RunConfig.vocab_size = "
                       f"{self.vocab_size}")
        c = constraints
        out += c.batch_problems(self) + c.schedule_problems(self) + c.strategy_problems(self) + c.expert_problems(self)
        out += c.fp8_problems(self) + c.context_problems(self)
        if self.strategy == "pp":
            out += c.pipeline_problems(self)
        for i, fault in enumerate(self.faults):
            out += [f"RunConfig.faults[{i}]: {why} (RunConfig.world_size = {self.world_size}, RunConfig.steps = "
                    f"{self.steps})" for why in fault.problems(self.world_size, self.steps)]
        return out

    def __repr__(self) -> str:
        """RunConfig(world_size=2, steps=30): only the fields that differ from the defaults (eval gives it back)."""
        from .display import config_repr
        return config_repr(self)

    def _repr_html_(self) -> str:
        from .display import config_html
        return config_html(self)

    def table(self) -> Any:
        """Every field: its value, its default, whether it changed (changed fields first), as a DataFrame."""
        from .display import config_table
        return config_table(self)

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
        """Read a config file a person wrote (RunConfig.save writes one); records.Run.config reads recorded ones.
        Every problem (no such file, not JSON, a bad field) is a ConfigError that names the file."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file (RunConfig(...).save({str(path)!r}) writes one)") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
