"""Seeds and reproducibility (lesson 08): the seeding tools labkit's loop uses, for your own rank functions.

    from labkit.tricks import seeds
    seeds.seed_everything(1234)                  # Python, NumPy, torch: the same everywhere (initial weights)
    seeds.seed_everything(1234, rank=ctx.rank)   # a stream of its own per rank (dropout, augmentation)
    seeds.rng_fingerprint()                      # short digests of the three generator states, to compare ranks
    seeds.set_deterministic(True); seeds.determinism_switches()   # ask torch for deterministic kernels; read back

The implementations live with the loop that calls them (labkit/training/seeding.py); this is the lesson's door.
"""
from ..training.seeding import determinism_switches, rng_fingerprint, seed_everything, set_deterministic

__all__ = ["seed_everything", "rng_fingerprint", "set_deterministic", "determinism_switches"]
