"""How lessons and benchmarks measure speed honestly: on pinned cores, with the other programs on those cores
metered, so that a speed claim is checked only when the cores were ours.

    cores.py       pinned_to(n), CpuMeter
"""
from .cores import CpuMeter, pinned_to

__all__ = ["CpuMeter", "pinned_to"]
