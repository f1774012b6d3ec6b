"""What a DDP wrapper put on the wire, and when: bytes per step, tensors sent twice or needlessly, overlap with
backward, bucket sizes. Reads the collectives that CommProbe recorded in each rank (see checks_ddp).

    check_traffic(report, outcomes)                  # bytes per step against one gradient of every trained tensor
    check_overlap(report, outcomes, required=True)   # did the all-reduces start before backward ended?
    check_buckets(report, outcomes, bucket_size_mb=0.01)
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from .references import plan_buckets
from .report import Report

SYNC_PHASES = ("backward", "finish")


def sync_events(out: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """The collectives one rank made for step `step`'s gradients (during backward and finish)."""
    return [e for e in out["events"] if e["step"] == step and e["phase"] in SYNC_PHASES]


def check_traffic(report: Report, outcomes: list[dict[str, Any]]) -> None:
    """Bytes all-reduced per step against the bytes of one gradient of every trained parameter."""
    rows = outcomes[0]["params"]
    trained = sum(r["bytes"] for r in rows if r["requires_grad"])
    frozen = {r["label"] for r in rows if not r["requires_grad"]}
    per_step = [sync_events(outcomes[0], s) for s in range(len(outcomes[0]["steps"]))]
    sent = statistics.median(sum(e["bytes"] for e in events) for events in per_step)
    count = statistics.median(len(events) for events in per_step)
    report.measured.update(allreduces_per_step=count, bytes_per_step=sent, bytes_ratio=sent / trained)
    if count == 0:
        report.add("traffic", "fail", "no collective was seen during backward or finish_gradient_synchronization(): "
                   "labkit watches torch.distributed's functions called as dist.all_reduce(...) (a name imported "
                   "with `from torch.distributed import ...` before the check is not seen)")
        return
    before = len(report.findings)
    _per_tensor(report, outcomes, frozen)
    forward = [e for e in outcomes[0]["events"] if e["phase"] == "forward"]
    if forward:
        kinds = ", ".join(sorted({e["op"] for e in forward}))
        report.add("traffic", "note", f"forward() made {len(forward)} collectives ({kinds}) over "
                   f"{len(per_step)} steps: DDP needs none there")
    explained = len(report.findings) > before
    ratio = sent / trained
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
        report.add("traffic", "fail", what)
    elif ratio < 0.999:
        report.add("traffic", "fail", f"your all-reduces carried only {ratio:.3f}× the trained parameters' "
                   f"gradient bytes per step ({int(trained - sent):,} bytes short): some gradients were not sent")
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
            labels = Counter(record["tensors"].get(e["ptr"]) for e in events)
            size = {record["tensors"].get(e["ptr"]): e["bytes"] for e in events}
            for label, times in labels.items():
                if label is None or label in said:
                    continue
                kind, name = label.split(" ", 1)
                if name in frozen:
                    said.add(label)
                    report.add("traffic", "fail", f"a parameter with requires_grad=False was all-reduced: {name} "
                               f"({size[label]:,} bytes per step that change nothing)")
                elif kind == "parameter":
                    said.add(label)
                    report.add("traffic", "fail", f"the parameter {name} itself was all-reduced, not its gradient")
                elif times > 1:
                    said.add(label)
                    tied = " = " in name
                    report.add("traffic", "fail", ("tied weights were" if tied else "a gradient was") +
                               f" all-reduced {times} times per step: {name} is one tensor; all-reduce it once "
                               f"({(times - 1) * size[label]:,} extra bytes per step on rank {out['rank']})")


def check_overlap(report: Report, outcomes: list[dict[str, Any]], required: bool) -> None:
    """When the gradients' collectives started, against backward's end; blocking calls inside backward; handles
    left running after finish_gradient_synchronization()."""
    fractions, firsts, gaps, blocking, blocked_ms, backward_ms = [], [], [], [], [], []
    for out in outcomes:
        for step, record in enumerate(out["steps"]):
            if record["unfinished"]:
                report.add("overlap", "fail", f"{record['unfinished']} async collectives were still running when "
                           f"finish_gradient_synchronization() returned (rank {out['rank']}, step {step}): wait() "
                           "on every handle before the optimizer reads the gradients")
                return
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
        return
    fraction, first = statistics.median(fractions), statistics.median(firsts)
    report.measured.update(overlap_fraction=fraction, first_launch=first, blocking_in_backward=max(blocking),
                           backward_ms=statistics.median(backward_ms))
    status = "fail" if required else "note"
    if max(blocking):
        report.add("overlap", status, f"{max(blocking)} all-reduces per step ran with async_op=False inside "
                   f"backward: each held backward up until it finished ({statistics.median(blocked_ms):.1f} ms of "
                   f"backward's {statistics.median(backward_ms):.1f} ms were spent in them); pass async_op=True and "
                   "wait in finish_gradient_synchronization()")
    elif fraction == 0:
        gap = statistics.median(gaps)
        if required:
            report.add("overlap", "fail", f"your all-reduces did not overlap backward: the first started {gap:.2f} "
                       "ms after backward ended (start each one from a gradient hook, as its gradient is ready)")
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
    if biggest > max(cap, largest):
        report.add("buckets", "fail", f"an all-reduce carried {biggest:,} bytes with bucket_size_mb={bucket_size_mb} "
                   f"({cap:,.0f} bytes; the largest single gradient is {largest:,}): close a bucket before it "
                   "overflows")
    elif count > 2 * greedy and count > 1:
        report.add("buckets", "fail", f"{count} all-reduces per step with bucket_size_mb={bucket_size_mb}: a greedy "
                   f"packing in backward order needs {greedy} buckets of that size; fill a bucket before sending it")
    else:
        report.add("buckets", "pass", f"{count} all-reduces per step with bucket_size_mb={bucket_size_mb} (a greedy "
                   f"packing in backward order makes {greedy}); the largest carried {biggest:,} bytes")
