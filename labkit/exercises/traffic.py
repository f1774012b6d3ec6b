"""What a DDP wrapper put on the wire, and when: bytes per step, tensors sent twice or needlessly, overlap with
backward, bucket sizes. Reads the collectives that CommProbe recorded in each rank (see checks_ddp).

    check_traffic(report, outcomes)                  # bytes per step against one gradient of every trained tensor
    check_overlap(report, outcomes, required=True)   # did the all-reduces start before backward ended?
    check_buckets(report, outcomes, bucket_size_mb=0.01)
"""
from __future__ import annotations

import itertools
import statistics
from collections import Counter
from typing import Any

from .references import plan_buckets
from .report import Report

SYNC_PHASES = ("backward", "finish")


def sync_events(out: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """The collectives one rank made for step `step`'s gradients (during backward and finish)."""
    return [e for e in out["events"] if e["step"] == step and e["phase"] in SYNC_PHASES]


def _made_by(out: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """The learner's function that made most of `events` (else the wrapper's finish_gradient_synchronization)."""
    callers = [e.get("caller", "") for e in events if e.get("caller")]
    return max(set(callers), key=callers.count) if callers else f"{out['class']}.finish_gradient_synchronization"


def _hook_part(out: dict[str, Any]) -> str:
    """Where gradient hooks are: the learner's hook function, else the wrapper's constructor (that registers them)."""
    return out["hooks"][0] if out.get("hooks") else f"{out['class']}.__init__"


def check_traffic(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """Bytes all-reduced per step against the bytes of one gradient of every trained parameter."""
    out0 = outcomes[0]
    rows = out0["params"]
    trained = sum(r["bytes"] for r in rows if r["requires_grad"])
    frozen = {r["label"] for r in rows if not r["requires_grad"]}
    steps = len(out0["steps"])
    per_step = [sync_events(out0, s) for s in range(steps)]
    sent = statistics.median(sum(e["bytes"] for e in events) for events in per_step)
    count = statistics.median(len(events) for events in per_step)
    report.measured.update(allreduces_per_step=count, bytes_per_step=sent, bytes_ratio=sent / trained)
    p2p = [e for e in out0.get("p2p", []) if e["phase"] in SYNC_PHASES]
    right = report.status("gradients") == "pass"
    if count == 0:
        if p2p:
            kinds = ", ".join(sorted({e["op"] for e in p2p}))
            report.add("traffic", "note" if right else "fail", f"the gradients travelled by point-to-point calls "
                       f"({kinds}: {len(p2p) / steps:g} per step on rank 0, {sum(e['bytes'] for e in p2p) / steps:,.0f}"
                       " bytes), not collectives: the bytes of one all-reduce per gradient are not compared",
                       part="" if right else _made_by(out0, p2p))
            return
        report.add("traffic", "note" if right else "fail",
                   ("the gradients are right, but " if right else "") + "no collective was seen during backward or "
                   "finish_gradient_synchronization(): labkit watches torch.distributed's functions called as "
                   "dist.all_reduce(...); a name imported with `from torch.distributed import ...` before the check "
                   "is not seen", part="" if right else _hook_part(out0) if out0.get("hooks") else
                   f"{out0['class']}.finish_gradient_synchronization")
        return
    ops = sorted({e["op"] for events in per_step for e in events} | {e["op"] for e in p2p})
    before = len(report.findings)
    _per_tensor(report, outcomes, frozen)
    forward = [e for e in out0["events"] if e["phase"] == "forward"]
    if forward:
        kinds = ", ".join(sorted({e["op"] for e in forward}))
        report.add("traffic", "note", f"forward() made {len(forward)} collectives ({kinds}) over "
                   f"{steps} steps: DDP needs none there")
    explained = len(report.findings) > before
    if ops != ["all_reduce"]:
        if not explained:
            report.add("traffic", "note", f"the gradients travelled by {', '.join(ops)} ({count:g} calls per step on "
                       f"rank 0, {int(sent):,} bytes counted): only all-reduces are compared with one gradient of "
                       "each trained parameter, so the bytes are not judged")
        return
    ratio = sent / trained
    part = _made_by(out0, [e for events in per_step for e in events])
    if ratio > 1.001 and not explained:
        extra = int(sent - trained)
        same = [r for r in rows if r["bytes"] == extra and (r["tied"] or not r["requires_grad"])]
        if same and same[0]["tied"]:
            what = f"tied weights were all-reduced twice: each step carried {extra:,} extra bytes, exactly the " \
                   f"size of {same[0]['label']} (one tensor, {len(same[0]['label'].split(' = '))} names)"
        elif same:
            what = f"a parameter with requires_grad=False was all-reduced: each step carried {extra:,} extra " \
                   f"bytes, exactly the size of {same[0]['label']}"
        else:
            what = f"your all-reduces carried {ratio:.3f}× one gradient of every trained parameter per step " \
                   f"({extra:,} extra bytes)"
        report.add("traffic", "fail", what, part=part)
    elif ratio < 0.999:
        report.add("traffic", "fail", f"your all-reduces carried only {ratio:.3f}× the trained parameters' "
                   f"gradient bytes per step ({int(trained - sent):,} bytes short): some gradients were not sent",
                   part=part)
    elif not explained:
        report.add("traffic", "pass", f"{count:g} collectives per step carried {int(sent):,} bytes = {ratio:.2f}× "
                   "one gradient of each trained parameter (the tied weight once, the frozen layer not at all)")


def _per_tensor(report: Report, outcomes: list[dict[str, Any]], frozen: set[str]) -> None:
    """Name tensors that were all-reduced more than once per step, frozen ones, and parameters sent instead of
    their gradients (only where a collective's tensor is a parameter's own gradient or data, not a flat buffer)."""
    said: set[str] = set()
    for out in outcomes:
        for step, record in enumerate(out["steps"]):
            events = sync_events(out, step)
            labels = Counter(record["tensors"].get(e["ptr"]) for e in events if e["op"] == "all_reduce")
            first = {}
            for e in events:
                first.setdefault(record["tensors"].get(e["ptr"]), e)
            for label, event in first.items():
                if label is None or label in said:
                    continue
                kind, name = label.split(" ", 1)
                times, size = labels.get(label, 0), event["bytes"]
                part = event.get("caller") or f"{out['class']}.finish_gradient_synchronization"
                if name in frozen:
                    said.add(label)
                    report.add("traffic", "fail", f"a parameter with requires_grad=False was all-reduced: {name} "
                               f"({size:,} bytes per step that change nothing)", part=part)
                elif kind == "parameter":
                    said.add(label)
                    report.add("traffic", "fail", f"the parameter {name} itself was sent ({event['op']}), not its "
                               "gradient", part=part)
                elif times > 1:
                    said.add(label)
                    tied = " = " in name
                    report.add("traffic", "fail", ("tied weights were" if tied else "a gradient was") +
                               f" all-reduced {times} times per step: {name} is one tensor; all-reduce it once "
                               f"({(times - 1) * size:,} extra bytes per step on rank {out['rank']})", part=part)


def check_overlap(report: Report, outcomes: list[dict[str, Any]], required: bool) -> None:
    """When the gradients' collectives started, against backward's end; blocking calls inside backward; handles
    left running after finish_gradient_synchronization()."""
    fractions, firsts, gaps, blocking, blocked_ms, backward_ms = [], [], [], [], [], []
    for out in outcomes:
        for step, record in enumerate(out["steps"]):
            events = sync_events(out, step)
            if not events:
                continue
            start, end = record["backward_start"], record["backward_end"]
            total = sum(e["bytes"] for e in events) or 1
            fractions.append(sum(e["bytes"] for e in events if e["start"] < end) / total)
            first = min(e["start"] for e in events)
            firsts.append((first - start) / (end - start))
            gaps.append((first - end) * 1e3)
            inside = [e for e in events if e["phase"] == "backward" and not e["async_op"]]
            blocking.append(len(inside))
            blocked_ms.append(sum((e["end"] or e["start"]) - e["start"] for e in inside) * 1e3)
            backward_ms.append((end - start) * 1e3)
    if not fractions:
        if required:
            report.add("overlap", "fail", "no dist collective was seen during backward or "
                       "finish_gradient_synchronization(), so no overlap could be measured: the exercise asks for "
                       "dist.all_reduce(..., async_op=True) started from a gradient hook", part=_hook_part(outcomes[0]))
        return
    fraction, first = statistics.median(fractions), statistics.median(firsts)
    report.measured.update(overlap_fraction=fraction, first_launch=first, blocking_in_backward=max(blocking),
                           backward_ms=statistics.median(backward_ms))
    status = "fail" if required else "note"
    inside = [e for out in outcomes for step in range(len(out["steps"])) for e in sync_events(out, step)
              if e["phase"] == "backward" and not e["async_op"]]
    if max(blocking):
        report.add("overlap", status, f"{max(blocking)} all-reduces per step ran with async_op=False inside "
                   f"backward: each held backward up until it finished ({statistics.median(blocked_ms):.1f} ms of "
                   f"backward's {statistics.median(backward_ms):.1f} ms were spent in them); pass async_op=True and "
                   "wait in finish_gradient_synchronization()",
                   part=_made_by(outcomes[0], inside) if required else "")
    elif fraction == 0:
        gap = statistics.median(gaps)
        if required:
            report.add("overlap", "fail", f"your all-reduces did not overlap backward: the first started {gap:.2f} "
                       "ms after backward ended (start each one from a gradient hook, as its gradient is ready)",
                       part=_hook_part(outcomes[0]))
        else:
            report.add("overlap", "note", f"nothing overlapped backward: every all-reduce started after it ended "
                       f"(the first {gap:.2f} ms after), as in naive DDP")
    else:
        report.add("overlap", "pass", f"{fraction:.0%} of the gradient bytes were on their way before backward "
                   f"ended; the first collective started {first:.0%} of the way into backward")


def check_buckets(report: Report, outcomes: list[dict[str, Any]], bucket_size_mb: float) -> None:
    """Messages no bigger than a bucket (or one gradient, if that is bigger), and not many more than needed."""
    cap = bucket_size_mb * 2**20
    sizes = [r["bytes"] for r in outcomes[0]["params"] if r["requires_grad"]][::-1]
    greedy, largest = len(plan_buckets(sizes, cap)), max(sizes)
    per_step = [sync_events(outcomes[0], s) for s in range(len(outcomes[0]["steps"]))]
    count = int(statistics.median(len(events) for events in per_step))
    biggest = max((e["bytes"] for events in per_step for e in events), default=0)
    report.measured.update(buckets_per_step=count, largest_message=biggest, greedy_buckets=greedy)
    part = f"{outcomes[0]['class']}.__init__"
    pairs = [(a["bytes"], b["bytes"]) for events in per_step for a, b in itertools.pairwise(events)
             if a["bytes"] + b["bytes"] <= cap]
    if biggest > max(cap, largest):
        report.add("buckets", "fail", f"an all-reduce carried {biggest:,} bytes with bucket_size_mb={bucket_size_mb} "
                   f"({cap:,.0f} bytes; the largest single gradient is {largest:,}): close a bucket before it "
                   "overflows", part=part)
    elif count > 2 * greedy and count > 1:
        report.add("buckets", "fail", f"{count} all-reduces per step with bucket_size_mb={bucket_size_mb}: a greedy "
                   f"packing in backward order needs {greedy} buckets of that size; fill a bucket before sending it",
                   part=part)
    elif pairs:
        report.add("buckets", "fail", f"two all-reduces sent one after the other carried {pairs[0][0]:,} and "
                   f"{pairs[0][1]:,} bytes: together {sum(pairs[0]):,}, within bucket_size_mb={bucket_size_mb} "
                   f"({cap:,.0f} bytes), so they fit one bucket. Fill a bucket until the next gradient would overflow "
                   "it (bucket_size_mb is in MiB: 2**20 bytes)", part=part)
    else:
        report.add("buckets", "pass", f"{count} all-reduces per step with bucket_size_mb={bucket_size_mb} (a greedy "
                   f"packing in backward order makes {greedy}); the largest carried {biggest:,} bytes")
