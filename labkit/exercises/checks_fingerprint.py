"""Two ranks' fingerprints compared: the field that differs named, then a function that finds every
such field, run on 2 real gloo ranks started differently (lesson 01).

    DIFFERS = ...                                    # ✏️ the field you predict differs (the stub)
    report = check_differs(DIFFERS, flagged)         # flagged: envcheck.mismatches of the run
    def fields_that_differ(prints): ...              # every rank's fingerprint -> the fields
    report = check_fields_that_differ(fields_that_differ)
    fields_that_differ = report.use(differing_fields)   # yours if it passed

The function's checker starts 2 gloo ranks with environment variables planted at random (a
variable on rank 0 only, one on rank 1 only, one set on both to other values), gathers every rank's
envcheck.fingerprint() with all_gather_object, and calls the learner's function on every rank:
with the planted fields, and with them taken out (no field differs then). It judges the answer
against the planted names, not against envcheck.mismatches, and names the usual mistakes:

    one rank's fields  a field set on one rank only was missed: only one rank's keys were walked
    per-rank fields    pid, hostname or cpu_affinity named: they differ by design
    one field          only the first difference returned
    not names          values, or one string, returned where a list of field names belongs
    ranks disagree     the ranks returned different answers (and so would not all refuse to start)
"""
from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable

import torch.distributed as dist

from ..run import RankFailure, launch
from ..tricks import envcheck
from .answers import check_name
from .learner import learner_part, report_failure
from .report import Report

POOL = ("NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_ALGO", "NCCL_DEBUG",
        "TORCH_DISTRIBUTED_DEBUG", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "NCCL_PROTO")


def differing_fields(prints: list[dict[str, str]]) -> list[str]:
    """labkit's reference: the fields whose value is not the same on every rank (a field missing on
    a rank counts), pid, hostname and cpu_affinity left out; sorted."""
    names = sorted(set().union(*prints))
    per_rank = {"pid", "hostname", "cpu_affinity"}
    return [n for n in names if n not in per_rank and len({p.get(n) for p in prints}) > 1]


def check_differs(answer: Any, flagged: list[str]) -> Report:
    """Judge the predicted field against what envcheck flagged:  check_differs(DIFFERS, flagged)."""
    want = flagged[0] if len(flagged) == 1 else tuple(flagged)
    bare = want[len("env."):] if isinstance(want, str) and want.startswith("env.") else None
    wrong = {"pid": "pid differs on every run, by design: the table marks it 'may differ' and "
                    "never flags it",
             "hostname": "one machine, one hostname; on many nodes it would differ by design",
             "backend": "both ranks talk over gloo: the backend in use is the same",
             "nccl": "NCCL's version reads 'None' on both ranks: a CPU build has no NCCL to ask",
             "torch": "both ranks run the same torch: one process started them both"}
    if bare:
        wrong[bare] = f"that is the variable; the field is named {want!r}, as the table shows it"
    report = check_name(answer, "the field that differs", want=want, wrong=wrong)
    # blame the learner's name, not the words that describe it
    report.findings = [dataclasses.replace(f, part="DIFFERS") if f.part else f
                       for f in report.findings]
    return report


def _drive(ctx: Any, fn: Callable, name: str, planted: list[str]) -> dict[str, Any]:
    prints: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(prints, envcheck.fingerprint())
    clean = [{k: v for k, v in p.items() if k[len("env."):] not in planted} for p in prints]
    with learner_part(ctx, name):
        planted_answer, clean_answer = fn([dict(p) for p in prints]), fn(clean)
    return {"planted": planted_answer, "clean": clean_answer, "prints": prints}


def _plant(seed: int | None) -> tuple[dict[int, dict[str, str]], list[str]]:
    """rank 0 only, rank 1 only, both with other values: three variables drawn from POOL."""
    draw = random.Random(seed)
    only0, only1, both = draw.sample(POOL, 3)
    env = {0: {only0: str(draw.randint(1, 9)), both: "1"},
           1: {only1: str(draw.randint(1, 9)), both: "2"}}
    return env, [only0, only1, both]


def _as_names(answer: Any) -> list[str] | None:
    if isinstance(answer, (list, tuple, set)) and all(isinstance(a, str) for a in answer):
        return sorted(answer)
    return None


def check_fields_that_differ(fn: Callable, *, seed: int | None = None, timeout: float = 20.0,
                             runs_root: Any = None) -> Report:
    """Run `fn(prints)` on 2 gloo ranks started differently:  check_fields_that_differ(f).ok."""
    name = getattr(fn, "__name__", "fields_that_differ")
    env, planted = _plant(seed)
    report = Report(f"{name}: 2 gloo ranks started with {', '.join(planted)} set differently",
                    implementation=fn)
    drive = functools.partial(_drive, fn=fn, name=name, planted=planted)
    try:   # learner.run_checked's launch, with each rank's own environment
        run = launch(drive, world_size=2, timeout=timeout, echo=False, progress=False,
                     name=f"check-{name}", runs_root=runs_root, env=env)
    except RankFailure as failure:
        return report_failure(report, failure, "Your function compares dicts: it needs no "
                                               "collective.")
    report.run_dir = run.path
    outcomes = [run.result(rank) for rank in range(2)]
    want = sorted(f"env.{v}" for v in planted)
    for key, expected, said in (("planted", want, "with the planted variables"),
                                ("clean", [], "with the planted variables taken out")):
        answers = [o[key] for o in outcomes]
        if len({repr(_as_names(a) or a) for a in answers}) > 1:
            report.add("ranks", "fail", f"{said}, the ranks returned different answers "
                                        f"({answers}): each rank must reach the same verdict",
                       part=name)
            return report
        got = _as_names(answers[0])
        if got is None:
            report.add("fields", "fail", f"{said}, your {name} returned {answers[0]!r}: return "
                                         "the fields' names, a list of str", part=name)
            return report
        if got != expected:
            report.add("fields", "fail", f"{said}: " + _why(got, expected, env), part=name)
            return report
    report.measured["fields"] = want
    report.add("fields", "pass", f"on both ranks, exactly the planted {', '.join(want)} were "
                                 "named, and nothing once they were taken out")
    return report


def _why(got: list[str], want: list[str], env: dict[int, dict[str, str]]) -> str:
    per_rank = sorted(set(got) & {"pid", "hostname", "cpu_affinity"})
    if per_rank:
        return (f"{', '.join(per_rank)} named: they differ by design (each process has its own "
                "pid; nodes have names; ranks are pinned to cores): leave pid, hostname and "
                "cpu_affinity out")
    if len(got) == 1 and len(want) > 1 and got[0] in want:
        return (f"only {got[0]} was named, of the {len(want)} fields that differ "
                f"({', '.join(want)}): return them all")
    missed = [w for w in want if w not in got]
    for rank, other in ((0, 1), (1, 0)):
        only = [f"env.{v}" for v in env[rank] if v not in env[other]]
        if only and set(only) <= set(missed):
            return (f"{', '.join(only)} is set on rank {rank} only and was missed: walk the fields "
                    f"of every rank (their union), not one rank's; a field missing on a rank is a "
                    "difference")
    extra = [g for g in got if g not in want]
    return (f"you named {got}, the fields that differ are {want}"
            + (f": {', '.join(extra)} is the same on every rank" if extra else ""))
