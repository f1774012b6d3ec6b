"""How lessons and benchmarks measure speed honestly: on pinned cores, with the other programs on those cores
metered, so that a speed claim is checked only when the cores were ours.

    cores.py       usable_cores(), pinned_to(n), pin_rank(r), CpuMeter, wait_for_quiet: the cores a block runs on, and who kept them busy
    timing.py      interleaved(variants, rounds=, cores=): several variants timed side by side, least disturbed kept
    metered.py     metered(fn, cores=): any measurement (a benchmark, a sweep) pinned and metered, made again on demand
    bounds.py      below(value, limit), above(value, limit): a claim's number against its limit, with its margin
    claims.py      gated(claim, check, measured): check a speed claim on a quiet measurement, or say NOT CHECKED;
                   not_checked(claim, reason): a claim this machine cannot check, counted as skipped;
                   checked_unless(reason, claim, check, measured): checked where it can be, else not_checked
    lesson.py      Claims("07"): a lesson's claims, each checked and shown in one line, and its closing table
    mfu.py         mfu(run): model FLOPs utilization (Run.mfu, the peak measured by matmul_flops()); flops_per_token
                   (6N + 12·L·h·s), matmul_params (N from Run.model()), utilization: the formula's parts
"""
from .bounds import Bound, above, below
from .claims import Outcome, checked_unless, gated, not_checked, summary_lines
from .lesson import ClaimFailed, Claims
from .cores import CpuMeter, pin_rank, pinned_to, usable_cores
from .metered import Metered, metered, together
from .mfu import flops_per_token, matmul_flops, matmul_params, mfu, utilization
from .timing import Timing, Timings, interleaved, steady_step_s, steady_window

__all__ = ["Bound", "above", "below", "CpuMeter", "pinned_to", "pin_rank", "usable_cores", "interleaved", "Timing",
           "Timings", "steady_window", "steady_step_s", "gated", "Outcome", "Claims", "ClaimFailed", "summary_lines",
           "not_checked", "checked_unless", "metered", "Metered", "together"]
__all__ += ["mfu", "flops_per_token", "matmul_params", "utilization", "matmul_flops"]
