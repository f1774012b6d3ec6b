"""Speed claims checked only on cores that were ours: measure, retry while other programs were busy on the pinned
cores, then check (assert) or say NOT CHECKED, and keep a record either way.

    timed = interleaved({"0 workers": cfg, "2 workers": cfg.replace(data_workers=2)}, rounds=2, cores=2, warmup=4)

    def workers_cut_the_wait(timed):
        assert timed["2 workers"].step_s < 0.75 * timed["0 workers"].step_s

    gated("05: 2 workers cut the step time", workers_cut_the_wait, timed)   # retries call timed.again()

Other programs on our cores only take time away, and unevenly, so a speed comparison made while they ran says
little either way. The gate judges a measurement by the cores other programs kept busy on the pinned cores (the
CpuMeter's `others`; for a Timings, its busiest variant). Over `limit`, it waits a little (WAIT_S) for the cores to
fall quiet and measures again, at most `attempts` times in all. Then it either runs the check and records "checked"
(an AssertionError is recorded as "failed" and raised), or records "skipped" and prints NOT CHECKED with the
reason. A skipped claim is not a passed claim: each outcome is appended as one JSON line to the file that
LABKIT_CLAIMS_LOG names, and `make test` counts them.

Waiting is bounded for a whole lesson, not only per claim, so that a lesson on a busy machine takes about what its
own work takes there (about twice its quiet time when every core is busy), not minutes more: the waits and the
measurements made again by every gate of one process together get RETRY_BUDGET_S seconds (LABKIT_GATE_BUDGET_S
sets it; 0: never measure again), and once a wait has ended with the cores still busy, a claim measured busy
within the next BUSY_MEMORY_S seconds is skipped without waiting (a busy loop that outlasted one wait is not
waited out claim after claim). The reason printed says which bound applied.

A claim that cannot be checked here at all (py-spy refused by ptrace, no GPU) is recorded the same way, so that it
is counted and named, not skipped in silence:

    not_checked("12: py-spy dumps the stuck rank from outside", f"py-spy could not read the ranks: {problem}")
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

from .bounds import Bound, collecting

# Other programs may keep up to this many of the pinned cores busy. Lesson 05's claims leave margins of 10-25%; on 2
# cores, others at 0.25 core (12% of them) during one run of a pair was measured to flip such a claim.
LIMIT_CORES = 0.2
ATTEMPTS = 3           # measurements in all, the first included
LOG_ENV = "LABKIT_CLAIMS_LOG"
WAIT_S = 5.0           # one wait for the cores to fall quiet, before measuring again
RETRY_BUDGET_S = 15.0  # waiting and measuring again, for every gate of this process together
BUDGET_ENV = "LABKIT_GATE_BUDGET_S"
BUSY_MEMORY_S = 60.0   # after a wait that ended busy, busy claims this soon after are skipped without waiting


@dataclasses.dataclass
class _Retries:
    """What this process's gates have spent on waiting and measuring again, and when a wait last ended busy."""
    spent_s: float = 0.0
    still_busy_at: float = -math.inf

    def budget_s(self) -> float:
        return float(os.environ.get(BUDGET_ENV, RETRY_BUDGET_S))

    def why_not(self) -> str:
        """Why this process may not wait and measure again now ("" when it may)."""
        if time.monotonic() - self.still_busy_at < BUSY_MEMORY_S:
            ago = time.monotonic() - self.still_busy_at
            return f"; the cores were still busy after a wait {ago:.0f} s ago, so no waiting again"
        if self.spent_s >= self.budget_s():
            return (f"; this process's {self.budget_s():g} s for waiting and measuring again are spent "
                    f"({BUDGET_ENV})")
        return ""


_retries = _Retries()


def reset_retries() -> None:
    """Forget what this process's gates have spent (a new lesson in the same process, a test)."""
    global _retries
    _retries = _Retries()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one gated claim."""
    claim: str
    status: str                   # "checked", "skipped" or "failed"
    attempts: int                 # measurements made (or reused) before deciding
    others: list[float]           # cores other programs kept busy, per attempt
    limit: float
    reason: str = ""
    time: float = dataclasses.field(default_factory=time.time)
    measured: str = ""            # what the check showed beside the claim (its return value, for a gated one)
    kind: str = "gated"           # "gated" (gated, not_checked, checked_unless) or "check" (Claims.check)
    bounds: list = dataclasses.field(default_factory=list)   # each Bound the check made, as a dict (measure.bounds)

    @property
    def checked(self) -> bool:
        return self.status == "checked"

    def __repr__(self) -> str:   # short: a claim left as a cell's last line shows its verdict, not every field
        return f"<{self.status}: {self.claim}>"


def gated(claim: str, check: Callable[[Any], None], measured: Any = None, *,
          measure: Callable[[], Any] | None = None, others: Callable[[Any], float] | None = None,
          wait: Callable[[float], float] | None = None, limit: float = LIMIT_CORES,
          attempts: int = ATTEMPTS) -> Outcome:
    """Run `check(measurement)` on a measurement during which other programs kept at most `limit` cores busy:

        gated("2 ranks scale", check, timed)                      # a Timings: retries measure it again()
        gated("fake", check, measure=lambda: next(fakes), others=lambda m: m["others"])   # any measurement

    measured: a measurement already made (the first attempt), or None to start by measuring.
    measure: makes a fresh one; default `measured.again()`. others: its others' cores; default `m.others`.
    wait(limit): called before measuring again; waits a while for the cores to fall quiet and returns the others'
    cores it saw last. Still busy: the claim is skipped without measuring in vain. Default: the measurement's own
    wait_for_quiet (a Timings watches its pinned cores), for at most WAIT_S, or no waiting. Waiting and measuring
    again are bounded for the whole process too (see the module docstring)."""
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        raise ValueError(f"attempts = {attempts!r}: must be an integer >= 1 (measurements in all)")
    if not (isinstance(limit, (int, float)) and limit >= 0):
        raise ValueError(f"limit = {limit!r}: must be a number of cores >= 0")
    if measure is None:
        if measured is None or not hasattr(measured, "again"):
            raise ValueError(f"claim {claim!r}: nothing to measure with; pass measure=, or a measurement that can "
                             "measure itself again (a measure.Timings)")
        measure = measured.again
    judge = others or (lambda m: float(m.others))
    if wait is None and hasattr(measured, "wait_for_quiet"):
        wait = lambda limit: measured.wait_for_quiet(limit, WAIT_S)  # noqa: E731
    seen: list[float] = []
    measurement = measured if measured is not None else measure()
    still = ""
    while True:
        seen.append(round(float(judge(measurement)), 3))
        if seen[-1] <= limit:
            return _check(claim, check, measurement, seen, limit)
        if len(seen) >= attempts:
            break
        still = _retries.why_not()
        if still:
            break
        started = time.monotonic()
        now = wait(limit) if wait is not None else 0.0
        if now > limit:
            _retries.spent_s += time.monotonic() - started
            _retries.still_busy_at = time.monotonic()
            still = f"; then still {now:.2f} while waiting to measure again"
            break
        measurement = measure()
        _retries.spent_s += time.monotonic() - started
    reason = (f"other programs kept {min(seen):.2f} to {max(seen):.2f} cores busy on the pinned cores in "
              f"{len(seen)} measurement{'s' * (len(seen) > 1)} (limit {limit:g}){still}")
    return shout(record(Outcome(claim, "skipped", len(seen), seen, limit, reason)))


def not_checked(claim: str, reason: str) -> Outcome:
    """Record `claim` as skipped for `reason` (something this machine cannot do, not a busy core) and print
    NOT CHECKED:  not_checked("12: py-spy reads the ranks", "ptrace is not permitted in this container")."""
    if not reason:
        raise ValueError(f"claim {claim!r}: say why it cannot be checked here")
    return shout(record(Outcome(claim, "skipped", 0, [], 0.0, reason)))


def checked_unless(reason: str | None, claim: str, check: Callable[[Any], None], measured: Any = None) -> Outcome:
    """A claim that only some machines can check (a tool not installed, ptrace refused): given a `reason`, print
    NOT CHECKED and record it as skipped, as gated does for busy cores; else run check(measured) and record it:
    checked_unless(None if spy.ok else spy.problem, "12: py-spy reads every rank", check, spy)."""
    if reason:
        return not_checked(claim, reason)
    with collecting() as bounds:
        try:
            said = check(measured)
        except AssertionError as failure:
            shout(record(Outcome(claim, "failed", 1, [], 0.0, failed_because(failure, bounds),
                                 bounds=kept(bounds))))
            raise
    return shout(record(Outcome(claim, "checked", 1, [], 0.0, measured=shown(said), bounds=kept(bounds))))


def kept(bounds: list[Bound]) -> list[dict]:
    """The bounds a check made, as the claims log holds them."""
    return [bound.as_dict() for bound in bounds]


def failed_because(failure: AssertionError, bounds: list[Bound]) -> str:
    """Why a check failed, in one line: its assertion's text, and each bound that did not hold (value, limit,
    margin), so that a failed claim says how far it missed even when its assert has no message."""
    said = str(failure).strip()
    missed = "; ".join(str(b) for b in bounds if not b.holds)
    text = f"{type(failure).__name__}: {said}" if said else type(failure).__name__
    return (f"{text} ({missed})" if said else f"{text}: {missed}") if missed else text


def _check(claim: str, check: Callable[[Any], None], measurement: Any, seen: list[float], limit: float) -> Outcome:
    with collecting() as bounds:
        try:
            said = check(measurement)
        except AssertionError as failure:
            shout(record(Outcome(claim, "failed", len(seen), seen, limit, failed_because(failure, bounds)[:500],
                                 bounds=kept(bounds))))
            raise
    retried = f", after {len(seen) - 1} busy measurement{'s' * (len(seen) > 2)}" if len(seen) > 1 else ""
    quiet = f"others kept {seen[-1]:.2f} cores busy{retried}"
    measured = f"{shown(said)} ({quiet})" if said is not None else quiet
    return shout(record(Outcome(claim, "checked", len(seen), seen, limit, measured=measured, bounds=kept(bounds))))


MARK = {"checked": "✓", "failed": "✗", "skipped": "○"}


def line(outcome: Outcome) -> str:
    """One outcome in one line, as lessons print it: '✓ 07: the claim — max gap 3.1e-06', '○ 05: the claim —
    NOT CHECKED: why', '✗ 09: the claim — measured: ...'."""
    tail = outcome.measured if outcome.status == "checked" else (
        f"NOT CHECKED: {outcome.reason}" if outcome.status == "skipped" else outcome.reason)
    return f"{MARK[outcome.status]} {outcome.claim}" + (f" — {tail}" if tail else "")


def shout(outcome: Outcome) -> Outcome:
    """Print the outcome's line and return it."""
    print(line(outcome))
    return outcome


def shown(value: Any) -> str:
    """A measured value as one short piece of text:  shown(3.1e-06) -> '3.1e-06'; shown({'a': 1.5}) -> 'a 1.5'."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {shown(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(shown(v) for v in value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:   # a numpy or torch scalar
        return shown(value.item())
    return str(value)


def record(outcome: Outcome, path: str | Path | None = None) -> Outcome:
    """Append `outcome` as one JSON line to `path` (default: the file LABKIT_CLAIMS_LOG names; none: no record)."""
    path = path or os.environ.get(LOG_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
    return outcome


def read_log(path: str | Path, since: float = 0.0) -> list[Outcome]:
    """The outcomes recorded in `path` at or after time `since` (time.time()):  read_log("claims.jsonl")."""
    path = Path(path)
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Outcome(**row) for row in rows if row.get("time", 0.0) >= since]


LESSON_OF = re.compile(r"^(\d\d[a-z]?): ")


def lesson_counts(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Per lesson (the claims' '07: ' prefix; 'other' without one), its claims by status, gated or not:
    lesson_counts(read_log(path)) -> {'07': {'checked': 14, 'failed': 0, 'skipped': 1}, ...}."""
    per: dict[str, dict[str, int]] = {}
    for o in outcomes:
        found = LESSON_OF.match(o.claim)
        counts = per.setdefault(found.group(1) if found else "other", {"checked": 0, "failed": 0, "skipped": 0})
        counts[o.status] += 1
    return dict(sorted(per.items()))


def floor_lines(outcomes: list[Outcome], floors: dict[str, int]) -> list[str]:
    """For each lesson that logged claims in `outcomes`, fewer than its floor (tests/claims_floor.json): one line
    each:  floor_lines(read_log(path), {"07": 13}) -> ['lesson 07: 12 claims logged, fewer than its floor of 13...']."""
    counts = {lesson: sum(by.values()) for lesson, by in lesson_counts(outcomes).items()}
    return [f"lesson {lesson}: {n} claims logged, fewer than its floor of {floors[lesson]} (tests/claims_floor.json)"
            for lesson, n in sorted(counts.items()) if lesson in floors and n < floors[lesson]]


def lesson_lines(outcomes: list[Outcome]) -> list[str]:
    """lesson_counts in words:  ['lesson 07: 14 checked, 0 failed, 1 not checked', ...]."""
    return [f"lesson {key}: {c['checked']} checked, {c['failed']} failed, {c['skipped']} not checked"
            for key, c in lesson_counts(outcomes).items()]


def summary_lines(outcomes: list[Outcome]) -> list[str]:
    """'gated claims: N checked, M skipped', then each skipped claim with its reason (and any failed); the speed
    claims skipped for busy cores and the claims this machine cannot check (not_checked) are counted alike:
    summary_lines(read_log(path))."""
    outcomes = [o for o in outcomes if o.kind == "gated"]   # lesson_lines counts every claim
    by = {status: [o for o in outcomes if o.status == status] for status in ("checked", "skipped", "failed")}
    head = f"gated claims: {len(by['checked'])} checked, {len(by['skipped'])} skipped"
    head += f", {len(by['failed'])} failed" if by["failed"] else ""
    return [head] + [f"  {o.status.upper()}: {o.claim} -- {o.reason}" for o in by["skipped"] + by["failed"]]
