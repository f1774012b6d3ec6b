"""Seeds that make runs repeatable, and the streams that must (and must not) match across ranks.

    from labkit.training.seeding import seed_everything, rng_fingerprint
    seed_everything(1234)                 # before building the model: the SAME on every rank -> same initial weights
    model = build_model()
    seed_everything(1234, rank=ctx.rank)  # after: a seed of this rank's own -> dropout, augmentation differ by rank

Why two phases. Initial weights must be equal on every rank (DDP broadcasts rank 0's anyway, but code that
reads weights before wrapping, or FSDP/TP shards, rely on it). Randomness *applied to data* (dropout masks,
augmentation, random crops) must differ between ranks: with one shared stream, every rank draws the same masks
for its different samples, and the "independent" noise of data parallelism is correlated across ranks.

Without any seeding, a process started fresh (torchrun, spawn) seeds torch, NumPy and Python from OS entropy:
runs differ every time. Forked processes are the opposite trap: each inherits its parent's generator states, so
every forked rank (and every unseeded forked worker) draws the *same* "random" numbers.
"""
from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import torch


def rank_seed(seed: int, rank: int) -> int:
    """A seed for `rank` derived from `seed`: distinct per rank, the same every run:  rank_seed(1234, 1)."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint32)[0])


def seed_everything(seed: int, rank: int | None = None) -> int:
    """Seed Python's random, NumPy and torch (CPU and every CUDA device); return the seed used.

    rank None: `seed` itself, the same on every rank. With a rank: rank_seed(seed, rank), one of its own."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed = {seed!r}: must be an integer >= 0")
    used = seed if rank is None else rank_seed(seed, rank)
    random.seed(used)
    np.random.seed(used)
    torch.manual_seed(used)  # also seeds every CUDA device's generator
    return used


def rng_fingerprint() -> dict[str, str]:
    """Short digests of the current Python, NumPy and torch generator states (compare them across ranks)."""
    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:12]
    return {"python": digest(repr(random.getstate()).encode()),
            "numpy": digest(repr(np.random.get_state()[1].tolist()).encode()),
            "torch": digest(torch.get_rng_state().numpy().tobytes())}


def set_deterministic(enabled: bool = True) -> None:
    """Ask torch for deterministic kernels (an error where none exists), and fix the cuBLAS workspace on GPUs.

    CUBLAS_WORKSPACE_CONFIG must be set before the first cuBLAS call of the process to take effect."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


def determinism_switches() -> dict[str, object]:
    """What this process's determinism switches read now (call it inside a rank to see what took effect there):
    determinism_switches()["deterministic_algorithms"] -> torch.are_deterministic_algorithms_enabled()."""
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn.deterministic": torch.backends.cudnn.deterministic,
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
