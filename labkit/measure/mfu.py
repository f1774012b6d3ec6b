"""MFU, model FLOPs utilization: the share of the ranks' peak FLOP/s the model's arithmetic used.

    mfu(run)                     # Run.mfu, one rank's peak measured by a matmul: mfu and its parts
    run.mfu(peak_flops=989e12)   # the same with a peak you know (an H100's dense bf16 peak)
    flops_per_token(params=70e9 - 0.26e9, layers=80, hidden=8192, seq=4096)   # 4.507e11
    utilization(achieved_flops_per_s=3e17, peak_flops=989e12, ranks=1024)    # 0.296
    matmul_flops()               # one fp32 thread's FLOP/s here, from square matmuls

The formula (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's estimate_mfu counts the same):

    FLOPs per token  = 6N + 12·L·h·s
    achieved FLOP/s  = FLOPs per token x tokens per second (all ranks together)
    MFU              = achieved FLOP/s / (peak FLOP/s of one rank x ranks)

6N: a matmul with N parameters costs 2N FLOPs per token forward (a multiply and an add per
weight) and 4N backward (the gradients of its input and of its weight, 2N each): 3 x forward.
12·L·h·s: attention's own matmuls, which have no parameters: a token's query against s keys
(2·h·s FLOPs) and its weights against s values (2·h·s), per layer forward, 3 x that with
backward. The whole s x s score matrix is counted, as PaLM counts it: a causal mask makes half
of it unneeded, and a kernel that skips the masked blocks (FlashAttention) does half this term;
the eager attention of the toy models here computes it whole, then masks it. Softmax, norms and
the optimizer are left out. Model FLOPs are what the model needs, whatever an implementation
recomputes (activation recomputation raises hardware FLOPs, not model FLOPs).

Which parameters N counts (labkit's convention; Task.model_fields records the counts with each
rank's first step, Run.model() reads them):
- not the embedding lookups (model_params_embedding): position embeddings, and token embeddings
  that are only looked up (an index, no matmul). A token embedding tied to the output layer
  (GPT-2's, tinylm's) is that layer's matmul weight and is counted. nanoGPT leaves out the
  position embedding alone, for the same reason;
- for a mixture of experts, the parameters one token uses (model_params_active): the router, the
  shared expert and top_k of the E routed experts of each layer, never all E (DeepSeek-V3: 671B
  parameters, 37B active).
So N = model_params_active - model_params_embedding (matmul_params). A run recorded before
labkit wrote these counts has none: Run.mfu says what is `missing` instead of a number.

The peak is per rank: a rank here is one process on one CPU core (one fp32 thread, what
matmul_flops measures); on GPUs, the GPU's datasheet peak at the run's precision. Runs with more
ranks than cores share the cores: their MFU against ranks x peak counts a peak the machine lacks.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ..records import Run, flops_per_token

__all__ = ["flops_per_token", "matmul_params", "utilization", "mfu", "matmul_flops"]


def matmul_params(model: dict[str, int]) -> int:
    """N of 6N from a run's counts (Run.model()): the parameters one token's matmuls use."""
    return model["params_active"] - model["params_embedding"]


def utilization(achieved_flops_per_s: float, peak_flops: float, ranks: int) -> float:
    """MFU: all ranks' achieved FLOP/s over all ranks' peak (`peak_flops` is one rank's)."""
    return achieved_flops_per_s / (peak_flops * ranks)


def mfu(run: Run, peak_flops: float | None = None) -> dict[str, Any]:
    """Run.mfu(peak_flops), one rank's peak measured by matmul_flops() when not given."""
    return run.mfu(peak_flops if peak_flops is not None else matmul_flops())


def matmul_flops(size: int = 256, seconds: float = 0.3) -> float:
    """FLOP/s of one fp32 thread here, from square matmuls (what one rank computes with):
    matmul_flops()."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        return 2 * size**3 * count / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
