"""Rules between fields: what one RunConfig field's value asks of the others (RunConfig.problems calls these once
every field is valid on its own; each returns sentences naming the fields to change, empty when all is well).

    batch_problems(RunConfig(global_batch=30, world_size=4))   # ["RunConfig.global_batch = 30: does not split ..."]
    pipeline_problems(cfg), strategy_problems(cfg), schedule_problems(cfg), expert_problems(cfg), fp8_problems(cfg)
    sequence_parallel_problems(cfg), recompute_problems(cfg)   # (strategy_problems calls both); context_problems

The field-by-field rules (types, ranges) and the choices each field offers are in rules.py.
"""
from __future__ import annotations

import importlib.util
from typing import Any

from .rules import LM_HEADS, SINGLE_STAGE_SCHEDULES, TP_DEGREES, TP_STRATEGIES, V_SCHEDULES


def batch_problems(config: Any) -> list[str]:
    cp = config.context_parallel if config.world_size % config.context_parallel == 0 else 1
    split = config.world_size // cp * config.grad_accum
    if config.global_batch % split:
        lower = max(split, config.global_batch // split * split)
        ranks = (f"RunConfig.world_size={config.world_size}" if cp == 1 else
                 f"RunConfig.world_size / context_parallel = {config.world_size // cp} data-parallel ranks")
        return [f"RunConfig.global_batch = {config.global_batch}: does not split evenly over {ranks} x "
                f"RunConfig.grad_accum={config.grad_accum} = {split}; use a multiple of {split}, e.g. {lower} or "
                f"{lower + split}"]
    return []


def context_problems(config: Any) -> list[str]:
    """Context parallelism splits tinylm's sequences over groups of context_parallel neighbours, inside DDP:

        context_problems(RunConfig(context_parallel=2, context_split="zigzag", seq_len=30))   # ["RunConfig.seq_len = 30: ..."]
    """
    cp, where = config.context_parallel, f"RunConfig.context_parallel = {config.context_parallel}"
    if cp == 1:
        return [f"RunConfig.{name} = {getattr(config, name)!r}: only means something with context_parallel > 1; "
                f"leave it at {default!r}" for name, default in (("context_method", "ring"),
                                                                 ("context_split", "contiguous"))
                if getattr(config, name) != default]
    if config.task != "tinylm":
        return [f"{where}: splits GPT-2's sequences (task 'tinylm'), not task {config.task!r}'s; leave it at 1"]
    out = []
    if config.strategy not in CONTEXT_STRATEGIES:
        why = {"pp": "a pipeline's stages exchange whole sequences here; pipeline x context parallelism is not "
                     "built"}.get(config.strategy, "the data-parallel ranks must replicate ('ddp') or shard ('fsdp') "
                                                   "the model, over the data and context dimensions together")
        out.append(f"{where}: not with RunConfig.strategy = {config.strategy!r} ({why}); use "
                   f"{' or '.join(map(repr, CONTEXT_STRATEGIES))}, with tensor_parallel for tensor parallelism")
    if config.world_size % (cp * config.tensor_parallel):
        out.append(f"{where}: must divide RunConfig.world_size = {config.world_size}"
                   + (f" / tensor_parallel {config.tensor_parallel}" if config.tensor_parallel > 1 else "")
                   + " (groups of neighbours share one batch)")
    chunks = cp * (2 if config.context_split == "zigzag" else 1)
    if config.seq_len % chunks:
        out.append(f"RunConfig.seq_len = {config.seq_len}: the {config.context_split} split over {cp} ranks cuts it "
                   f"into {chunks} equal chunks, so it must be divisible by {chunks}"
                   + (" (2 x context_parallel)" if config.context_split == "zigzag" else ""))
    heads = LM_HEADS[config.model_size]
    if config.context_method == "ulysses" and heads % cp:
        out.append(f"RunConfig.context_method = 'ulysses': hands each of the {cp} ranks whole heads, and model_size "
                   f"{config.model_size!r} has {heads}; use a context_parallel that divides {heads}, or 'ring'")
    if config.dropout:
        out.append(f"RunConfig.dropout = {config.dropout!r}: labkit's context-parallel attention has no attention "
                   "dropout; leave it at 0 with context_parallel > 1")
    return out


CONTEXT_STRATEGIES = ("ddp", "fsdp")
"""How the data-parallel ranks hold the model under context parallelism (its reduction covers dp x cp)."""
TENSOR_STRATEGIES = ("ddp", "fsdp", "pp")
"""What RunConfig.tensor_parallel composes with: DDP or FSDP2 over the data-parallel ranks left, or a pipeline
whose stages are split (training/parallel/distribute.py says in which order)."""


def tensor_parallel_problems(config: Any) -> list[str]:
    """RunConfig.tensor_parallel composed with the other parallelisms (tinylm; the presets set their own):

        tensor_parallel_problems(RunConfig(world_size=4, tensor_parallel=2, strategy="zero1"))   # ["...: use ..."]
    """
    t = config.tensor_parallel
    if t == 1:
        return []
    where = f"RunConfig.tensor_parallel = {t}"
    if config.strategy in TP_STRATEGIES:
        return [f"{where}: strategy {config.strategy!r} is a preset that sets the tensor-parallel degree itself "
                f"({'all the ranks' if config.strategy == 'tp' else '2'}); leave tensor_parallel at 1, or use "
                "strategy 'ddp' or 'fsdp' with tensor_parallel"]
    out = []
    if config.task != "tinylm":
        out.append(f"{where}: splits GPT-2's blocks (task 'tinylm'), not task {config.task!r}'s; tinymoe's tensor "
                   "parallelism is strategy 'fsdp+tp'; leave it at 1")
    if config.strategy not in TENSOR_STRATEGIES:
        out.append(f"{where}: composes with strategy {', '.join(map(repr, TENSOR_STRATEGIES))} (DDP or FSDP2 over "
                   f"the data-parallel ranks left, or pipeline stages), not {config.strategy!r}")
    if t not in TP_DEGREES:
        out.append(f"{where}: must divide every tinylm size's attention heads; use "
                   f"{' or '.join(map(str, TP_DEGREES[1:]))}")
    rest = t * config.context_parallel * ((config.pipeline_ranks or 1) if config.strategy == "pp" else 1)
    if config.world_size % rest:
        out.append(f"{where}: tensor x context x pipeline ranks = {rest} must divide RunConfig.world_size = "
                   f"{config.world_size} (the data-parallel ranks are what is left)")
    if config.strategy == "pp" and config.sequence_parallel:
        out.append(f"RunConfig.sequence_parallel = True: not with a pipeline ({where}): the stages would exchange "
                   "pieces of the sequence; leave it False")
    if config.strategy == "ddp" and config.comm_hook != "allreduce":
        out.append(f"RunConfig.comm_hook = {config.comm_hook!r}: DDP over tensor-parallel ranks ({where}) runs "
                   "with its default all-reduce here; leave comm_hook at 'allreduce'")
    if config.precision == "fp16" and config.strategy != "fsdp":   # fsdp's own rule says it
        out.append(f"{where}: RunConfig.precision = 'fp16' (a GradScaler over split gradients) is not supported "
                   "here; use 'bf16' or 'fp32'")
    return out


def schedule_problems(config: Any) -> list[str]:
    where = f"RunConfig.schedule = {config.schedule!r}"
    if config.schedule == "plateau" and not config.eval_every:
        return [f"{where} needs a held-out loss: set RunConfig.eval_every to how often to measure it, e.g. 5"]
    if config.schedule == "plateau" and config.plateau_factor >= 1.0:
        return [f"{where}: RunConfig.plateau_factor = {config.plateau_factor!r} must be below 1 (each cut "
                "multiplies the LR by it; torch's ReduceLROnPlateau refuses 1)"]
    if config.schedule == "cosine_restarts" and config.min_lr_ratio:
        return [f"{where}: transformers' restarts decay to 0; RunConfig.min_lr_ratio = {config.min_lr_ratio!r} "
                "must be 0 (or use 'cosine', which has a floor)"]
    if config.schedule == "polynomial" and config.min_lr_ratio >= 1.0:
        return [f"{where}: decays from lr to min_lr_ratio * lr, so RunConfig.min_lr_ratio = "
                f"{config.min_lr_ratio!r} must be below 1"]
    return []


def strategy_problems(config: Any) -> list[str]:
    """What the chosen strategy cannot do with the other fields (mesh shape, task, precision, comm hook)."""
    out = sequence_parallel_problems(config) + recompute_problems(config) + tensor_parallel_problems(config)
    field = f"RunConfig.strategy = {config.strategy!r}"
    if config.pipeline_zero1 and (config.strategy != "pp" or config.pipeline_dims[0] < 2):
        out.append(f"RunConfig.pipeline_zero1 = True: shards the optimizer state over each pipeline stage's data-"
                   f"parallel ranks, so it needs strategy 'pp' with world_size / pipeline_ranks >= 2 (here "
                   f"{field}, {config.pipeline_dims[0]} replica(s)); other strategies: use strategy 'zero1'")
    if config.strategy == "ddp":
        return out
    tp = config.parallel_dims.tp
    if config.strategy == "fsdp+tp" and (config.world_size < 4 or config.world_size % 2):
        out.append(f"{field}: its mesh is (world_size/2 data-parallel x 2 tensor-parallel) ranks, so "
                   f"RunConfig.world_size = {config.world_size} must be even and at least 4; use 4")
    if config.strategy == "tp" and tp not in TP_DEGREES:
        out.append(f"{field}: splits each block over all RunConfig.world_size = {config.world_size} ranks, which "
                   f"must divide the attention heads: use world_size {' or '.join(map(str, TP_DEGREES))}")
    if config.strategy in TP_STRATEGIES and config.task != "tinylm" and (config.task, config.strategy) != \
            ("tinymoe", "fsdp+tp"):
        out.append(f"{field}: tensor parallelism splits GPT-2 blocks (and tinymoe's layers under 'fsdp+tp'), so "
                   f"RunConfig.task must be 'tinylm' (not {config.task!r}); use strategy 'fsdp' or 'zero1' for "
                   "other models")
    if config.precision == "fp16":
        out.append(f"{field}: RunConfig.precision = 'fp16' (a GradScaler over sharded gradients) is not "
                   "supported here; use 'bf16' or 'fp32', or strategy 'ddp'")
    if config.strategy != "zero1" and config.comm_hook != "allreduce":
        out.append(f"{field}: RunConfig.comm_hook = {config.comm_hook!r} is a DDP comm hook; only 'ddp' and "
                   "'zero1' use DDP: leave comm_hook at 'allreduce'")
    return out


def recompute_problems(config: Any) -> list[str]:
    """Activation recomputation wraps GPT-2's blocks (training/parallel/recompute.py): tinylm only, and not under a
    pipeline (its stages are cut from the blocks) or context parallelism (its attention is replaced in place),
    neither of which has been tried with it."""
    if config.recompute == "none":
        return []
    where = f"RunConfig.recompute = {config.recompute!r}"
    if config.task != "tinylm":
        return [f"{where}: recomputes tinylm's GPT-2 blocks; RunConfig.task = {config.task!r} has none here; leave "
                "recompute at 'none'"]
    out = []
    if config.strategy == "pp":
        out.append(f"{where}: not with RunConfig.strategy = 'pp' (a stage holds a cut of the blocks); use 'ddp', "
                   "'zero1', 'zero2', 'fsdp', 'tp' or 'fsdp+tp'")
    if config.context_parallel > 1:
        out.append(f"{where}: not with RunConfig.context_parallel = {config.context_parallel}; leave one of them "
                   "at its default")
    return out


def sequence_parallel_problems(config: Any) -> list[str]:
    """Sequence parallelism is a variant of tensor parallelism: it needs a tensor-parallel strategy, a sequence
    that splits evenly over the tensor-parallel ranks, and no dropout (each rank would draw the mask of its piece
    of the sequence from the same random state: the pieces' masks would repeat)."""
    if not config.sequence_parallel:
        return []
    where, tp = "RunConfig.sequence_parallel = True", config.parallel_dims.tp
    if tp == 1:
        return [f"{where}: splits the sequence over tensor-parallel ranks, so RunConfig.strategy must be "
                f"{' or '.join(map(repr, TP_STRATEGIES))} (not {config.strategy!r}), or tensor_parallel above 1"]
    out = []
    if config.task != "tinylm":
        out.append(f"{where}: splits tinylm's GPT-2 blocks along the sequence; RunConfig.task = {config.task!r} has no "
                   "sequence-parallel plan here (tinymoe's 'fsdp+tp' splits MLA's heads only); leave it False")
    if config.seq_len % tp:
        out.append(f"{where}: RunConfig.seq_len = {config.seq_len} does not split evenly over {tp} tensor-parallel "
                   f"ranks; use a multiple of {tp}")
    if config.dropout:
        out.append(f"{where}: RunConfig.dropout = {config.dropout!r}: each rank would draw the dropout mask of its "
                   "piece of the sequence from the same random state; leave dropout at 0")
    return out


def pipeline_problems(config: Any) -> list[str]:
    """What a pipeline ("pp") cannot do with the other fields; each sentence names the field to change."""
    out, where = [], "RunConfig.strategy = 'pp'"
    replicas, p = config.pipeline_dims
    name, v, m = config.pipeline_schedule, config.stages_per_rank, config.microbatches
    if config.world_size % p or p < 2:
        return [f"RunConfig.pipeline_ranks = {config.pipeline_ranks}: the pipeline degree times the data-parallel "
                f"degree must equal RunConfig.world_size = {config.world_size}, with at least 2 ranks per pipeline; "
                f"use a divisor of {config.world_size} from 2 up (or 0: all of them)"]
    stages = p * v
    if config.task not in ("tinylm", "tinymoe"):
        out.append(f"{where}: cuts GPT-2 (or tinymoe's DeepSeek-V3) into stages of layers, so RunConfig.task must be "
                   f"'tinylm' or 'tinymoe' (not {config.task!r})")
    if name in SINGLE_STAGE_SCHEDULES and v != 1:
        out.append(f"RunConfig.stages_per_rank = {v}: pipeline_schedule {name!r} runs one stage per rank; use 1, "
                   "or a looped schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)")
    if name in V_SCHEDULES and v != 2:
        out.append(f"RunConfig.stages_per_rank = {v}: pipeline_schedule {name!r} needs exactly 2 stages per rank "
                   "(a V: rank 0 holds the first and the last); use 2")
    if name not in SINGLE_STAGE_SCHEDULES + V_SCHEDULES and v < 2:
        out.append(f"RunConfig.stages_per_rank = {v}: pipeline_schedule {name!r} loops several stages over each "
                   "rank; use 2 or more (or GPipe/1F1B for one stage per rank)")
    if config.blocks % stages:
        out.append(f"RunConfig.layers = {config.layers}: {config.blocks} blocks do not split evenly into {p} ranks x "
                   f"{v} stages per rank = {stages} stages; use a multiple of {stages}, e.g. {stages}")
    if config.global_batch % (replicas * m):
        out.append(f"RunConfig.microbatches = {m}: must divide each replica's batch (RunConfig.global_batch = "
                   f"{config.global_batch} over {replicas} replica(s)) evenly")
    if name in ("1F1B", "DualPipeV") and m < stages:
        out.append(f"RunConfig.microbatches = {m}: pipeline_schedule {name!r} needs at least as many "
                   f"microbatches as stages ({stages}); use {stages} or more")
    rounds = max(1, m // p)
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
        out.append(f"RunConfig.microbatches = {m}: pipeline_schedule {name!r} runs microbatches in rounds of the "
                   f"pipeline's {p} ranks ({rounds} round(s) here) and needs a multiple of the rounds; use "
                   f"{rounds * (m // rounds)} or {rounds * p}")
    for field, value, fine, why in (
            ("grad_accum", config.grad_accum, 1, "microbatches are the pipeline's accumulation"),
            ("clip_norm", config.clip_norm, None, "the global norm over stages is not measured here"),
            ("checkpoint_every", config.checkpoint_every, 0, "stage checkpoints are not written here"),
            ("dropout", config.dropout, 0.0, "pipeline_check compares with the unsplit model")):
        if value != fine:
            out.append(f"RunConfig.{field} = {value!r}: not with {where} ({why}); leave it at {fine!r}")
    if config.schedule == "plateau" or config.nan_policy not in ("raise", "ignore"):
        out.append(f"RunConfig.schedule = {config.schedule!r}, nan_policy = {config.nan_policy!r}: with {where} the "
                   "loss exists on the last stage only; use a schedule other than 'plateau' and nan_policy "
                   "'raise' or 'ignore'")
    return out


MOE_STRATEGIES = ("ddp", "fsdp", "fsdp+tp", "pp")
"""How tinymoe can be spread: DDP (+ expert_parallel), ZeRO-3 without and with TP (the article's), DeepSeek-V3's PP x EP
x ZeRO-1."""
MOE_ONLY = {"balancing": "none", "capacity_factor": None, "expert_parallel": 1, "language_skew": 0.0}
"""tinymoe's fields that change what a run does, at the values that change nothing (other tasks must keep them)."""


def expert_problems(config: Any) -> list[str]:
    """What tinymoe's fields cannot be together (called by RunConfig.problems once each field is valid on its own):

        expert_problems(RunConfig(task="tinymoe", experts=6, expert_groups=4))   # ["RunConfig.expert_groups = 4: ..."]
    """
    if config.task != "tinymoe":
        return [f"RunConfig.{name} = {getattr(config, name)!r}: exists for task 'tinymoe' only (RunConfig.task = "
                f"{config.task!r}); leave it at {default!r}" for name, default in MOE_ONLY.items()
                if getattr(config, name) != default]
    out, per_group = [], config.experts // config.expert_groups
    if config.experts % config.expert_groups or per_group < 2:
        out.append(f"RunConfig.expert_groups = {config.expert_groups}: must split RunConfig.experts = "
                   f"{config.experts} into equal groups of at least 2 (the router adds each group's two best "
                   f"scores), e.g. expert_groups = {max(1, config.experts // 4)}")
    elif config.group_top_k > config.expert_groups:
        out.append(f"RunConfig.group_top_k = {config.group_top_k}: a token cannot use more groups than "
                   f"RunConfig.expert_groups = {config.expert_groups}")
    elif config.top_k > config.group_top_k * per_group:
        out.append(f"RunConfig.top_k = {config.top_k}: more experts than the {config.group_top_k} group(s) a token "
                   f"may use hold ({config.group_top_k} x {per_group}); raise group_top_k or lower top_k")
    ep = config.expert_parallel
    if config.world_size % ep or config.experts % ep:
        out.append(f"RunConfig.expert_parallel = {ep}: must divide RunConfig.world_size = {config.world_size} (EP "
                   f"groups are carved out of the data-parallel ranks) and RunConfig.experts = {config.experts}")
    if ep > 1 and config.clip_norm is not None:
        out.append(f"RunConfig.clip_norm = {config.clip_norm!r}: under expert_parallel = {ep} each rank holds "
                   "different experts, and clipping here measures one rank's gradients only; leave it None")
    if config.strategy not in MOE_STRATEGIES:
        out.append(f"RunConfig.strategy = {config.strategy!r}: task 'tinymoe' spreads over ranks with "
                   f"{', '.join(map(repr, MOE_STRATEGIES))} (DDP with RunConfig.expert_parallel; ZeRO-3, and the "
                   "article's ZeRO-3 + TP; DeepSeek-V3's pipeline with experts inside its data parallelism)")
    elif config.strategy in ("fsdp", "fsdp+tp") and ep > 1:
        out.append(f"RunConfig.expert_parallel = {ep}: under strategy {config.strategy!r} the routed experts are "
                   "FSDP-sharded over the data-parallel ranks (parallel/moe_tp.py), not split by expert; use 1")
    elif config.strategy == "pp":
        out += _moe_pipeline_problems(config)
    if config.vocab_size % config.languages or config.branching > config.vocab_size // config.languages:
        out.append(f"RunConfig.languages = {config.languages}: each language gets vocab_size / languages tokens, "
                   f"so RunConfig.vocab_size = {config.vocab_size} must be a multiple of it and at least "
                   f"RunConfig.branching = {config.branching} times it")
    if config.schedule == "plateau":
        out.append("RunConfig.schedule = 'plateau': needs a held-out loss, which task 'tinymoe' does not provide")
    return out


FP8_ONLY = {"fp8_scaling": "tile", "fp8_grad_format": "e4m3", "fp8_engine": "labkit"}
"""Fields that only precision "fp8" reads, at their defaults (fp8_tile is read by fp8_dispatch too)."""


def fp8_problems(config: Any) -> list[str]:
    """What precision "fp8" and fp8_dispatch ask of the rest (training/fp8_layers.py says what they switch):

        fp8_problems(RunConfig(precision="fp8", strategy="fsdp"))   # ["RunConfig.precision = 'fp8': ..."]
    """
    out, fp8 = [], config.precision == "fp8"
    if fp8 and config.task not in ("tinylm", "tinymoe"):
        out.append(f"RunConfig.precision = 'fp8': switches transformers' GPT-2 and DeepSeek-V3 layers, so "
                   f"RunConfig.task must be 'tinylm' or 'tinymoe' (not {config.task!r})")
    if fp8 and (config.strategy not in ("ddp", "zero1") or config.tensor_parallel > 1):
        out.append(f"RunConfig.precision = 'fp8': with RunConfig.strategy = {config.strategy!r} the layers are "
                   "sharded or cut before they could be switched; use strategy 'ddp' or 'zero1'")
    if fp8 and config.fp8_engine == "torchao":
        out += _torchao_problems(config)
    if fp8 and config.fp8_scaling == "row" and config.fp8_tile:
        out.append(f"RunConfig.fp8_tile = {config.fp8_tile}: scaling 'row' takes whole rows, not tiles; leave "
                   "fp8_tile at 0 or use scaling 'tile'")
    unread = {} if fp8 else dict(FP8_ONLY)
    if not (fp8 or config.fp8_dispatch):
        unread["fp8_tile"] = 0
    out += [f"RunConfig.{name} = {getattr(config, name)!r}: read only with RunConfig.precision = 'fp8'"
            + (" or fp8_dispatch" if name == "fp8_tile" else "") + f"; leave it at {default!r} or set precision 'fp8'"
            for name, default in unread.items() if getattr(config, name) != default]
    if config.fp8_dispatch and (config.task != "tinymoe" or config.expert_parallel < 2):
        out.append(f"RunConfig.fp8_dispatch = True: FP8 travels in the expert-parallel dispatch, which needs "
                   f"RunConfig.task 'tinymoe' (not {config.task!r}) and RunConfig.expert_parallel >= 2 (not "
                   f"{config.expert_parallel})")
    return out


def torchao_available() -> bool:
    """Whether torchao (the fp8 extra: pip install 'labkit[fp8]') can be imported here; it is not imported."""
    return importlib.util.find_spec("torchao") is not None


def _torchao_problems(config: Any) -> list[str]:
    """fp8_engine "torchao": tinymoe (its nn.Linear layers), a recipe torchao runs on this machine, torchao itself."""
    out = []
    if config.task != "tinymoe":
        out.append(f"RunConfig.fp8_engine = 'torchao': torchao converts nn.Linear layers, and task {config.task!r} has "
                   "none to convert (GPT-2 computes with Conv1D); use task 'tinymoe' or fp8_engine 'labkit'")
    if config.fp8_scaling == "tile":
        out.append("RunConfig.fp8_engine = 'torchao' with fp8_scaling = 'tile': torchao's 1 x 128 / 128 x 128 "
                   "blockwise recipe is a Triton prototype that needs a GPU; use fp8_scaling 'tensor' or 'row', or "
                   "fp8_engine 'labkit' (its simulation of V3's tiles)")
    if not torchao_available():
        out.append("RunConfig.fp8_engine = 'torchao': torchao is not installed here; pip install 'labkit[fp8]' "
                   "(or `make install`), or use fp8_engine 'labkit'")
    return out


def _moe_pipeline_problems(config: Any) -> list[str]:
    """tinymoe in a pipeline (DeepSeek-V3's layout): experts split over each stage's data-parallel ranks or not at
    all; no balance loss (it is made in every stage, the loss only exists on the last)."""
    out, replicas = [], config.pipeline_dims[0]
    if config.expert_parallel not in (1, replicas):
        out.append(f"RunConfig.expert_parallel = {config.expert_parallel}: under strategy 'pp' the experts of each "
                   f"stage are split over that stage's data-parallel ranks (world_size / pipeline_ranks = "
                   f"{replicas}) or not at all; use {replicas} or 1")
    if config.balancing == "aux":
        out.append("RunConfig.balancing = 'aux': not with strategy 'pp' (each stage makes its layers' balance loss, "
                   "the language-model loss exists on the last stage only); use 'bias' or 'none'")
    if config.capacity_factor is not None and config.pipeline_check:
        out.append(f"RunConfig.capacity_factor = {config.capacity_factor!r}: pipeline_check compares with the unsplit "
                   "model on the whole batch, where capacity drops other tokens than per microbatch; set "
                   "pipeline_check = False, or capacity_factor = None")
    return out
