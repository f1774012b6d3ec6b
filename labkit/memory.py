"""How many bytes of model state each device holds under data parallelism, ZeRO's stages and tensor parallelism:
the formulas of the ZeRO paper (Rajbhandari et al., 2020, section 5) as pure functions.

    from labkit.tricks import memory          # also reachable as labkit.memory
    memory.model_state_bytes(7.5e9, stage=0, dp=64)          # 1.2e11: the paper's 120 GB baseline
    memory.model_state_bytes(7.5e9, stage=3, dp=64)          # 1.875e9: 1.9 GB with everything sharded
    memory.state_breakdown(1e6, stage=1, dp=2, param_bytes=4, grad_bytes=4, k=8)   # fp32 Adam on CPU, by part

Model state is three things per parameter: the parameter (2 bytes in fp16/bf16), its gradient (2 bytes), and the
optimizer state (K bytes; mixed-precision Adam keeps an fp32 master copy, momentum and variance: K = 4 + 4 + 4 = 12).
With Ψ parameters and N_d data-parallel ranks:

    stage 0  plain DDP, every rank holds everything       (2 + 2 + K) Ψ
    stage 1  P_os: optimizer state sharded                 2Ψ + 2Ψ + KΨ/N_d
    stage 2  P_os+g: and gradients                         2Ψ + (2 + K)Ψ/N_d
    stage 3  P_os+g+p: and parameters (FSDP)               (2 + 2 + K)Ψ/N_d

Tensor parallelism of degree T splits each layer's matrices over T ranks first: every rank holds Ψ/T of the model,
which the data-parallel formulas above then divide further.

Activations are not model state: what autograd keeps from forward for backward, per sample, so they grow with the
batch and the sequence, and no ZeRO stage shards them.
    memory.activation_bytes(seq=2048, batch=1, hidden=12288, heads=96, layers=1)   # Korthikanti et al.'s formula
The formula is Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
section 4: per transformer layer s·b·h·(34 + 5·a·s/h) bytes with 2-byte values and 1-byte dropout masks, where
s is the sequence length, b the micro-batch, h the width and a the heads; with tensor parallelism of degree t
(and no sequence parallelism) s·b·h·(10 + 24/t + 5·a·s/(h·t)). In values of s·b·h per layer: 4 kept whole on
every tensor-parallel rank (the two LayerNorm inputs, the attention's and the MLP's inputs), 12 split over t
(q, k, v, the attention output, the GeLU's input, the second linear's input), 2 one-byte dropout masks, and
a·s/h for the attention scores (softmax output, its dropout mask and output).
With sequence parallelism as well (section 4.2.2: the LayerNorms and dropouts run on 1/t of the sequence, and
the all-reduces become all-gathers and reduce-scatters) every term is split: s·b·h·(34/t + 5·a·s/(h·t)).
"""
from __future__ import annotations

from dataclasses import dataclass

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state on one rank, by part."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def state_breakdown(num_params: float, *, stage: int, dp: int, tp: int = 1, param_bytes: float = 2,
                    grad_bytes: float = 2, k: float = 12) -> StateBytes:
    """Per-rank bytes of parameters, gradients and optimizer state at ZeRO `stage` over `dp` data-parallel ranks,
    after tensor parallelism of degree `tp`:  state_breakdown(1e6, stage=2, dp=4).total."""
    _check(num_params, stage, dp, tp, k)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        if not value > 0:
            raise ValueError(f"{name} = {value!r}: must be > 0 (bytes per element: 2 for fp16/bf16, 4 for fp32)")
    psi = num_params / tp
    return StateBytes(params=param_bytes * psi / (dp if stage >= 3 else 1),
                      grads=grad_bytes * psi / (dp if stage >= 2 else 1),
                      optimizer=k * psi / (dp if stage >= 1 else 1))


def model_state_bytes(num_params: float, *, stage: int, dp: int, tp: int = 1, k: float = 12) -> float:
    """The ZeRO paper's per-device model-state bytes for mixed-precision training (2-byte parameters and gradients,
    K bytes of optimizer state per parameter); stage 0 is plain DDP:  model_state_bytes(7.5e9, stage=1, dp=64)."""
    return state_breakdown(num_params, stage=stage, dp=dp, tp=tp, k=k).total


def activation_bytes(*, seq: int, batch: int, hidden: int, heads: int, layers: int = 1, tp: int = 1,
                     value_bytes: float = 2, dropout: bool = True, scores: bool = True, whole_values: float = 4,
                     split_values: float = 12, outside_values: float = 0, norm_stats: bool = False,
                     sequence_parallel: bool = False, gathered_values: float = 0,
                     outside_gathered_values: float = 0, recompute: str = "none") -> float:
    """Bytes of activations one rank keeps for backward (Korthikanti et al. 2022, see the module docstring):
    activation_bytes(seq=2048, batch=1, hidden=12288, heads=96) is 34·s·b·h + 5·a·s²·b, the paper's layer;
    with sequence_parallel=True and tp=t, s·b·h·34/t + 5·a·s²·b/t (everything split).

    The defaults are the paper's case. Another model says how it differs, in values of s·b·h per layer:
    whole_values (kept whole on every tensor-parallel rank; the paper's 4) and split_values (split over tp; the
    paper's 12); value_bytes (4 in fp32); dropout=False (no one-byte masks); scores=False (a fused attention kernel
    keeps no s x s scores, only a float32 log-sum-exp per head and position); outside_values (s·b·h values kept
    outside the layers, e.g. the final LayerNorm's input and the LM head's input: 2); norm_stats (LayerNorm's mean
    and 1/std, two float32 per position, for 2 LayerNorms per layer and a final one).

    sequence_parallel splits over tp what tensor parallelism kept whole: the whole values, the dropout masks, the
    LayerNorm statistics and the outside values, except what an implementation keeps whole anyway:
    gathered_values per layer (the all-gathered inputs of the column-wise layers, where they are saved for
    backward rather than gathered again: torch's DTensor saves them, 2; Megatron-LM gathers again, the paper's 0)
    and outside_gathered_values (the LM head's gathered input, 1 where the head is not split).

    recompute: "none"; "selective" (the attention core is recomputed: no s x s scores, no log-sum-exp kept, the
    paper's 34·s·b·h per layer); "full" (each layer keeps its input only, s·b·h values, split along the sequence
    under sequence parallelism; the paper's table writes 2·s·b·h·L, Megatron-LM's input being replicated there).
    What is kept outside the layers stays.
    """
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads), ("layers", layers),
                        ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be a whole number >= 1")
    if heads % tp or hidden % heads:
        raise ValueError(f"heads = {heads}, hidden = {hidden}, tp = {tp}: heads must divide hidden, tp must divide "
                         "heads (each tensor-parallel rank computes whole heads)")
    if not (0 <= gathered_values <= whole_values and 0 <= outside_gathered_values <= outside_values):
        raise ValueError(f"gathered_values = {gathered_values!r}, outside_gathered_values = "
                         f"{outside_gathered_values!r}: each is a part of whole_values = {whole_values!r} and "
                         f"outside_values = {outside_values!r}, so between 0 and those")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute = {recompute!r}: must be 'none', 'selective' or 'full'")
    sbh, positions = seq * batch * hidden, seq * batch
    sp = tp if sequence_parallel else 1  # what sequence parallelism divides; tensor parallelism alone keeps it whole
    kept = gathered_values if sequence_parallel else whole_values
    per_layer = (kept + (whole_values - kept) / sp) * sbh * value_bytes + split_values * sbh * value_bytes / tp
    if dropout:
        per_layer += 2 * sbh / sp  # one-byte masks after attention and after the MLP
    if recompute == "selective":
        pass  # the attention core is computed again in backward: neither scores nor a log-sum-exp are kept
    elif scores:  # softmax output and dropout output (values), and the dropout mask (one byte)
        per_layer += heads * seq * positions * (2 * value_bytes + (1 if dropout else 0)) / tp
    else:
        per_layer += heads * positions * 4 / tp
    kept = outside_gathered_values if sequence_parallel else outside_values
    outside = (kept + (outside_values - kept) / sp) * sbh * value_bytes
    if norm_stats:
        per_layer += 2 * 2 * positions * 4 / sp
        outside += 2 * positions * 4 / sp
    if recompute == "full":
        per_layer = sbh * value_bytes / sp  # the layer's input: everything else is computed again in backward
    return layers * per_layer + outside


def _check(num_params: float, stage: int, dp: int, tp: int, k: float) -> None:
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)) or not num_params > 0:
        raise ValueError(f"num_params = {num_params!r}: must be a number of parameters > 0")
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"stage = {stage!r}: must be 0 (DDP), 1 (optimizer state), 2 (+ gradients) or 3 (+ params)")
    for name, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be a whole number of ranks >= 1")
    if isinstance(k, bool) or not isinstance(k, (int, float)) or k < 0:
        raise ValueError(f"k = {k!r}: must be the optimizer's bytes of state per parameter, >= 0 (Adam: 12)")
