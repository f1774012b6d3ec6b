"""Speed claims checked only on cores that were ours: measure, retry while other programs were busy on the pinned
cores, then check (assert) or say NOT CHECKED, and keep a record either way.

    timed = interleaved({"0 workers": cfg, "2 workers": cfg.replace(data_workers=2)}, rounds=2, cores=2, warmup=4)

    def workers_cut_the_wait(timed):
        assert timed["2 workers"].step_s < 0.75 * timed["0 workers"].step_s

    gated("05: 2 workers cut the step time", workers_cut_the_wait, timed)   # retries call timed.again()

Other programs on our cores only take time away, and unevenly, so a speed comparison made while they ran says
little either way. The gate judges a measurement by the cores other programs kept busy on the pinned cores (the
CpuMeter's `others`; for a Timings, its busiest variant). Over `limit`, it waits a little for the cores to fall
quiet and measures again, at most `attempts` times in all (if they stay busy, it stops there: measuring again
would be in vain, and a lesson's cell must end in minutes). Then it either runs the check and records "checked" (an AssertionError is recorded as "failed" and
raised), or records "skipped" and prints NOT CHECKED with the reason. A skipped claim is not a passed claim: each
outcome is appended as one JSON line to the file that LABKIT_CLAIMS_LOG names, and `make test` counts them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

# Other programs may keep up to this many of the pinned cores busy. Lesson 05's claims leave margins of 10-25%; on 2
# cores, others at 0.25 core (12% of them) during one run of a pair was measured to flip such a claim.
LIMIT_CORES = 0.2
ATTEMPTS = 3           # measurements in all, the first included
LOG_ENV = "LABKIT_CLAIMS_LOG"


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

    @property
    def checked(self) -> bool:
        return self.status == "checked"


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
    wait_for_quiet (a Timings watches its pinned cores for up to 10 s), or no waiting."""
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
    wait = wait or getattr(measured, "wait_for_quiet", None)
    seen: list[float] = []
    measurement = measured if measured is not None else measure()
    still = ""
    while True:
        seen.append(round(float(judge(measurement)), 3))
        if seen[-1] <= limit:
            return _check(claim, check, measurement, seen, limit)
        if len(seen) >= attempts:
            break
        now = wait(limit) if wait is not None else 0.0
        if now > limit:
            still = f"; then still {now:.2f} while waiting to measure again"
            break
        measurement = measure()
    reason = (f"other programs kept {min(seen):.2f} to {max(seen):.2f} cores busy on the pinned cores in "
              f"{len(seen)} measurement{'s' * (len(seen) > 1)} (limit {limit:g}){still}")
    print(f"NOT CHECKED, {claim}: {reason}")
    return record(Outcome(claim, "skipped", len(seen), seen, limit, reason))


def _check(claim: str, check: Callable[[Any], None], measurement: Any, seen: list[float], limit: float) -> Outcome:
    try:
        check(measurement)
    except AssertionError as failure:
        record(Outcome(claim, "failed", len(seen), seen, limit, f"{type(failure).__name__}: {failure}"[:500]))
        raise
    retried = f", after {len(seen) - 1} busy measurement{'s' * (len(seen) > 2)}" if len(seen) > 1 else ""
    print(f"checked, {claim} (others: {seen[-1]:.2f} cores{retried})")
    return record(Outcome(claim, "checked", len(seen), seen, limit))


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


def summary_lines(outcomes: list[Outcome]) -> list[str]:
    """'gated speed claims: N checked, M skipped', then each skipped claim with its reason (and any failed):
    summary_lines(read_log(path))."""
    by = {status: [o for o in outcomes if o.status == status] for status in ("checked", "skipped", "failed")}
    head = f"gated speed claims: {len(by['checked'])} checked, {len(by['skipped'])} skipped"
    head += f", {len(by['failed'])} failed" if by["failed"] else ""
    return [head] + [f"  {o.status.upper()}: {o.claim} -- {o.reason}" for o in by["skipped"] + by["failed"]]
