"""One all_reduce's time, predicted from the ring model's fitted α and B, then measured (lesson 02).

    PREDICTED_MS = ...                     # ✏️ your prediction, in milliseconds (the stub)
    report = check_ring_time(PREDICTED_MS, size_bytes=3 * 2**20, world=2, alpha=alpha,
                             bandwidth=bandwidth)
    PREDICTED_MS = report.use(report.measured["formula"])   # yours once it passed, else the model's
    report.measured["measured"]            # the ms this machine took (a note, never a verdict)

The model is lesson 02's, fitted by comm.fit_ring_model: t(S) = 2(n-1)·α + 2(n-1)/n · S/B, α in
seconds per ring step, B in bytes per second. The number is judged against that formula (within
2 %, answers.check_number); a wrong one that equals a usual slip is named as that slip: α
forgotten, α paid once instead of at each of the 2(n-1) ring steps, the 2(n-1)/n factor forgotten
(it is 1 at n = 2, so it shows only on more ranks), bits for bytes, seconds or microseconds for
milliseconds, MB (10**6) for MiB (2**20). Then the checker measures the same all_reduce on `world`
gloo ranks (comm.benchmark: the median of repeats, its slowest rank) and says how far the model
and this machine part: a note, since a time on a shared machine judges nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..tricks import comm
from .answers import check_number
from .report import Report

NAME = "PREDICTED_MS"


def ring_time_ms(size_bytes: float, world: int, alpha: float, bandwidth: float) -> float:
    """The reference: the ring model's ms for one all_reduce of `size_bytes` on `world` ranks."""
    return 1e3 * (2 * (world - 1) * alpha + 2 * (world - 1) / world * size_bytes / bandwidth)


def slips(size_bytes: float, world: int, alpha: float, bandwidth: float) -> dict[str, float]:
    """The usual wrong numbers, each with the sentence that names it (in ms, as asked)."""
    n, s, b = world, float(size_bytes), float(bandwidth)
    latency, wire = 2 * (n - 1) * alpha, 2 * (n - 1) / n * s / b
    right = latency + wire
    return {
        "α is forgotten: that is the bandwidth term alone; each of the 2(n-1) ring steps also "
        "pays α": 1e3 * wire,
        "α is paid once; a ring pays it at each of its 2(n-1) steps: 2(n-1)·α":
            1e3 * (alpha + wire),
        "the 2(n-1)/n factor is forgotten: a ring all_reduce sends each byte 2(n-1)/n times; "
        "S/B is a broadcast's": 1e3 * (latency + s / b),
        "bits for bytes: S and B are both in bytes (fit_ring_model's B is bytes/s), no factor 8":
            1e3 * (latency + 8 * wire),
        "bytes taken as bits: S and B are both in bytes, no division by 8":
            1e3 * (latency + wire / 8),
        "that is in seconds; the answer is asked in milliseconds (x 1000)": right,
        "that is in microseconds; the answer is asked in milliseconds (/ 1000)": 1e6 * right,
        "MB for MiB: the size is in binary units, 1 MiB = 2**20 bytes, not 10**6":
            1e3 * (latency + wire * 1e6 / 2**20),
    }


def measure_ms(size_bytes: int, world: int, *, repeats: int = 7, runs_root: Any = None) -> float:
    """The median ms of one all_reduce of `size_bytes` on `world` gloo ranks (its slowest rank)."""
    table = comm.benchmark(ops=("all_reduce",), sizes=[int(size_bytes)], world_size=world,
                           repeats=repeats, backend="gloo", runs_root=runs_root)
    return float(table["time_s"].iloc[0]) * 1e3


def check_ring_time(predicted_ms: Any, *, size_bytes: int, world: int, alpha: float,
                    bandwidth: float, measure: bool = True, runs_root: Any = None) -> Report:
    """Judge PREDICTED_MS against the ring model, then measure:  check_ring_time(x, ...).ok."""
    formula = ring_time_ms(size_bytes, world, alpha, bandwidth)
    # a slip that gives the right number at this world size is no slip here
    wrong = {why: value for why, value in slips(size_bytes, world, alpha, bandwidth).items()
             if abs(value - formula) > 0.02 * formula}
    try:   # the slip nearest the answer is the one named, when two lie near each other
        wrong = dict(sorted(wrong.items(), key=lambda item: abs(item[1] - float(predicted_ms))))
    except (TypeError, ValueError):
        pass
    measured = measure_ms(size_bytes, world, runs_root=runs_root) if measure else None
    said = f"{NAME} (one all_reduce of {comm.human_bytes(size_bytes)} on {world} ranks, ms)"
    report = check_number(predicted_ms, said, formula=formula, measured=measured, slips=wrong,
                          unit=" ms")
    # blame the learner's name, not the sentence that describes it
    report.findings = [dataclasses.replace(f, part=NAME) if f.part else f for f in report.findings]
    report.measured.update({"formula": formula, "measured": measured})
    if predicted_ms is Ellipsis and measured is not None:
        report.add("measured", "note", f"this machine measured {measured:.3g} ms; the model says "
                                       f"{formula:.3g} ms: write your prediction, then run again")
    return report
