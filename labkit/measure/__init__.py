"""How lessons and benchmarks measure speed honestly: on pinned cores, with the other programs on those cores
metered, so that a speed claim is checked only when the cores were ours.

    cores.py       pinned_to(n), CpuMeter, wait_for_quiet: the cores a block runs on, and who kept them busy
    timing.py      interleaved(variants, rounds=, cores=): several variants timed side by side, least disturbed kept
    claims.py      gated(claim, check, measured): check a speed claim on a quiet measurement, or say NOT CHECKED
"""
from .claims import Outcome, gated
from .cores import CpuMeter, pinned_to
from .timing import Timing, Timings, interleaved, steady_step_s, steady_window

__all__ = ["CpuMeter", "pinned_to", "interleaved", "Timing", "Timings", "steady_window", "steady_step_s", "gated",
           "Outcome"]
