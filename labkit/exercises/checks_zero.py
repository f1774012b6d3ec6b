"""Check a hand-written sharded optimizer (ZeRO stage 1) on real gloo ranks against one process and the formula.

    report = check_sharded_optimizer(MyShardedOptimizer)                       # wraps torch.optim.AdamW(lr=0.01)
    report = check_sharded_optimizer(MyShardedOptimizer, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    report.measured["state_fraction"]         # per rank: share of the trained parameters it holds state for

It is built as sharded_cls(param_groups, optimizer_cls, **optimizer_kwargs) on every rank around the same CheckNet,
with three param groups (weights; biases without weight decay; the frozen layer); the driver averages gradients
itself, so only the optimizer is under test. Measured: every rank's parameters after each step (against each other,
and against one process running optimizer_cls over all parameters, its learning rate changed on param_groups before
each step as an LR scheduler would), the optimizer state each rank holds (walked from the object: bytes, and which
parameters), set against the ZeRO paper's stage-1 formula from labkit.memory with K measured from the unsharded
optimizer, and the bytes each step sent.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..measure import usable_cores
from ..memory import state_breakdown
from .learner import run_checked
from .report import Report
from .zero_rank import drive_sharded

DEFAULT_KWARGS = {"lr": 0.01, "weight_decay": 0.1}
TOLERANCE = 1e-5


def check_sharded_optimizer(sharded_cls: Any, optimizer_cls: Any = torch.optim.AdamW,
                            optimizer_kwargs: dict[str, Any] | None = None, *, world_size: int = 2, steps: int = 3,
                            timeout: float = 30.0, runs_root: Any = None) -> Report:
    """Run `sharded_cls` on `world_size` gloo ranks and report on it:  check_sharded_optimizer(ShardedOptimizer).ok."""
    kwargs = dict(DEFAULT_KWARGS if optimizer_kwargs is None else optimizer_kwargs)
    name = getattr(sharded_cls, "__name__", repr(sharded_cls))
    inner = f"{optimizer_cls.__name__}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    cores = usable_cores()
    crowded = f"; {world_size} ranks on {cores} cores, oversubscribed" if world_size > cores else ""
    report = Report(f"{name} over {inner} on {world_size} gloo ranks, {steps} steps{crowded}",
                    implementation=sharded_cls)
    outcomes = run_checked(report, functools.partial(drive_sharded, sharded_cls=sharded_cls,
                                                     optimizer_cls=optimizer_cls, kwargs=kwargs, steps=steps),
                           world_size=world_size, timeout=timeout, name=f"check-{name}", runs_root=runs_root)
    if outcomes is None:
        return report
    if any(out.get("unbuilt") for out in outcomes):
        report.add("runs", "fail", f"after construction your {name} has no param_groups: torch.optim.Optimizer's "
                   "__init__ (super().__init__(params, defaults)) never ran, so no parameter was registered",
                   part=f"{outcomes[0]['class']}.__init__")
        return report
    check_agreement(report, outcomes)
    check_senders(report, outcomes)
    check_against_one_process(report, outcomes, inner)
    check_state(report, outcomes, optimizer_cls.__name__)
    check_step_traffic(report, outcomes)
    return report


def check_agreement(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """After every step all ranks must hold the same parameters."""
    owners = _owners(outcomes)
    for step in range(len(outcomes[0]["steps"])):
        ours = outcomes[0]["steps"][step]["params"]
        for out in outcomes[1:]:
            differing = {name: (t - ours[name]).abs().max().item()
                         for name, t in out["steps"][step]["params"].items() if not torch.equal(t, ours[name])}
            if differing:
                name = max(differing, key=differing.get)
                held = owners.get(name, [])
                whose = f"its optimizer state is on rank {', '.join(map(str, held))}" if held else \
                    "no rank holds its optimizer state"
                report.add("agreement", "fail", f"after step {step} rank {out['rank']}'s parameters differ from rank "
                           f"0's in {len(differing)} tensors (by up to {max(differing.values()):.3g}); e.g. {name}: "
                           f"{whose}. After stepping its share, each rank must send its updated parameters to the "
                           "others (broadcast from the owner)", part=f"{out['class']}.step")
                return
    report.add("agreement", "pass", f"after each of {len(outcomes[0]['steps'])} steps every rank holds the same "
               "parameters, bitwise")


def builder(outcomes: list[dict[str, Any]]) -> str:
    """The learner's function that built the inner optimizer or gave it its param groups (where the shards are
    decided), else the class's add_param_group."""
    found = [c for out in outcomes for c in out.get("built_by", [])]
    return found[-1] if found else f"{outcomes[0]['class']}.add_param_group"


def check_senders(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """Each parameter must be sent from the rank that holds its state (the one that stepped it)."""
    if report.status("agreement") == "fail":
        return
    rows = outcomes[0]["params"]
    for out in outcomes:
        for event in out["events"]:
            index = out["ptrs"].get(event["ptr"])
            if event["phase"] != "step" or event["op"] != "broadcast" or index is None or event["src"] is None:
                continue
            holders = [o["rank"] for o in outcomes if index in o["owned"]]
            if holders and event["src"] not in holders:
                report.add("senders", "fail", f"{rows[index]['label']} is stepped on rank "
                           f"{', '.join(map(str, holders))} (its optimizer state is there) but broadcast from rank "
                           f"{event['src']}, which did not step it: the rank whose local optimizer holds a "
                           "parameter must be the one that sends it", part=builder(outcomes))
                return


def check_against_one_process(report: Report, outcomes: list[dict[str, Any]], inner: str) -> None:
    """The parameters must follow one process running the wrapped optimizer over every parameter."""
    if report.status("agreement") == "fail":
        report.add("matches", "note", f"not compared with one process running {inner}: the ranks disagree")
        return
    if report.status("senders") == "fail":
        report.add("matches", "note", f"not compared with one process running {inner}: see senders")
        return
    reference = outcomes[0]["reference"]
    worst, where = 0.0, ""
    for step, record in enumerate(outcomes[0]["steps"]):
        for name, value in record["params"].items():
            gap = (value - reference["params"][step][name]).abs().max().item()
            if gap > worst:
                worst, where = gap, f"step {step}, {name}"
    report.measured["param_diff"] = worst
    if worst <= TOLERANCE:
        report.add("matches", "pass", f"the parameters follow one process running {inner} over all parameters "
                   f"(largest difference {worst:.1e} over {len(outcomes[0]['steps'])} steps)")
        return
    mismatch = next((m for out in outcomes for m in out.get("mismatches", [])), None)
    if mismatch is not None:
        name = outcomes[0]["params"][mismatch["index"]]["label"] if mismatch["index"] is not None else "a parameter"
        scheduled = mismatch["step"] > 0 and mismatch["key"] == "lr" and not any(
            m["step"] == 0 for out in outcomes for m in out.get("mismatches", []))
        had = (f"at step {mismatch['step']} the optimizer that stepped {name} had {mismatch['key']}="
               f"{mismatch['inner']}, where your param_groups say {mismatch['key']}={mismatch['outer']}")
        report.add("matches", "fail", f"the parameters differ from one process running {inner} by up to {worst:.3g} "
                   f"({where}): " + (f"the lr set on param_groups before each step (as an LR scheduler does) did not "
                                     f"reach the optimizer that steps ({had}). Pass each param_group's settings on "
                                     "to your local optimizer before stepping it" if scheduled else
                                     f"{had}: each param group's settings must reach the parameters it holds"),
                   part=f"{outcomes[0]['class']}.step" if scheduled else builder(outcomes))
        return
    deaf = max((value - reference["unscheduled"][step][name]).abs().max().item()
               for step, record in enumerate(outcomes[0]["steps"]) for name, value in record["params"].items())
    if deaf <= TOLERANCE:   # (with no lr to schedule the two references are one, and deaf == worst)
        report.add("matches", "fail", f"the parameters differ from one process running {inner} by up to {worst:.3g} "
                   f"({where}), and follow, to {deaf:.1e}, one whose learning rate never changed: the lr set on "
                   "param_groups before each step (as an LR scheduler does) did not reach the optimizer that steps. "
                   "Pass each param_group's settings on to your local optimizer before stepping it",
                   part=f"{outcomes[0]['class']}.step")
        return
    first = outcomes[0]["steps"][0]["params"]
    moved = sum((first[n] - reference["init"][n]).norm().item() for n in first)
    expected = sum((reference["params"][0][n] - reference["init"][n]).norm().item() for n in first)
    ratio = moved / expected if expected else float("nan")
    report.measured["first_step_ratio"] = ratio
    report.add("matches", "fail", f"the parameters differ from one process running {inner} by up to {worst:.3g} "
               f"({where}); your first step moved them {ratio:.2f}× as far as that optimizer does (are "
               "optimizer_kwargs passed on? is every parameter stepped once?)", part=builder(outcomes))


def check_state(report: Report, outcomes: list[dict[str, Any]], optimizer_name: str) -> None:
    """Each trained parameter's state on exactly one rank, each rank near 1/N of it: measured against ZeRO-1."""
    world = len(outcomes)
    rows = outcomes[0]["params"]
    reference = outcomes[0]["reference"]
    trained = list(reference["owned"])  # the parameters the unsharded optimizer keeps state for
    if not trained:
        report.add("state", "note", f"{optimizer_name} keeps no per-parameter state: nothing to shard")
        return
    psi = sum(rows[i]["numel"] for i in trained)
    k = reference["state_bytes"] / psi
    formula = state_breakdown(psi, stage=1, dp=world, param_bytes=4, grad_bytes=4, k=k).optimizer
    fractions = [sum(rows[i]["numel"] for i in out["owned"] if i in trained) / psi for out in outcomes]
    report.measured.update(state_bytes=[out["state_bytes"] for out in outcomes], state_fraction=fractions,
                           formula_bytes=formula, unsharded_bytes=reference["state_bytes"], k=k)
    holders = {i: [out["rank"] for out in outcomes if i in out["owned"]] for i in trained}
    fullest = max(range(world), key=lambda r: fractions[r])
    emptiest = min(range(world), key=lambda r: fractions[r])
    on_fullest = [i for i in outcomes[fullest]["owned"] if i in trained]
    smallest = min(on_fullest, key=lambda i: rows[i]["numel"]) if on_fullest else None
    part = builder(outcomes)
    if world > 1 and min(fractions) > 0.999:
        report.add("state", "fail", f"optimizer state on rank {world - 1} holds {fractions[-1]:.0%} of the "
                   f"parameters, expected about {1 / world:.0%}: each rank should create optimizer_cls over its own "
                   "share only", part=part)
    elif any(len(h) > 1 for h in holders.values()):
        i = next(i for i, h in holders.items() if len(h) > 1)
        report.add("state", "fail", f"{rows[i]['label']} has optimizer state on ranks "
                   f"{', '.join(map(str, holders[i]))}: each parameter's state belongs on one rank")
    elif any(not h for h in holders.values()):
        i = next(i for i, h in holders.items() if not h)
        report.add("state", "fail", f"{rows[i]['label']} has optimizer state on no rank: no rank steps it", part=part)
    elif smallest is not None and (fractions[fullest] - fractions[emptiest]) * psi > max(
            rows[i]["numel"] for i in on_fullest):
        shares = ", ".join(f"rank {r} {f:.0%}" for r, f in enumerate(fractions))
        report.add("state", "fail", f"the shards are unbalanced ({shares} of the parameters' state; 1/{world} each "
                   f"is {1 / world:.0%}): rank {fullest} holds more than rank {emptiest} by more than its largest "
                   f"tensor, so moving its {rows[smallest]['label']} ({rows[smallest]['numel']:,} elements) to rank "
                   f"{emptiest} would even them. Give each parameter to the rank holding the least so far",
                   part=part)
    else:
        per_rank = ", ".join(f"rank {o['rank']} {o['state_bytes']:,} B ({f:.0%} of the parameters)"
                             for o, f in zip(outcomes, fractions))
        report.add("state", "pass", f"optimizer state per rank: {per_rank}; unsharded {optimizer_name}: "
                   f"{reference['state_bytes']:,} B; ZeRO-1 formula KΨ/N_d = {formula:,.0f} B (K = {k:.2f} bytes "
                   f"per parameter, measured; Ψ = {psi:,.0f}; N_d = {world})")


def check_step_traffic(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """What one optimizer step sent from rank 0 (a note: ZeRO-1 sends each updated parameter once per step)."""
    steps = len(outcomes[0]["steps"])
    events = [e for e in outcomes[0]["events"] if e["phase"] == "step"]
    sent = sum(e["bytes"] for e in events) / max(steps, 1)
    total = sum(r["bytes"] for r in outcomes[0]["params"] if r["requires_grad"])
    kinds = ", ".join(sorted({e["op"] for e in events})) or "none"
    report.measured.update(step_bytes=sent, step_collectives=len(events) / max(steps, 1))
    report.add("traffic", "note", f"each step made {len(events) / max(steps, 1):g} collectives on rank 0 ({kinds}) "
               f"carrying {sent:,.0f} B = {sent / total:.2f}× the trained parameters' bytes")


def _owners(outcomes: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Parameter name -> the ranks holding its optimizer state."""
    rows = outcomes[0]["params"]
    owners: dict[str, list[int]] = {}
    for out in outcomes:
        for i in out["owned"]:
            owners.setdefault(rows[i]["name"], []).append(out["rank"])
    return owners
