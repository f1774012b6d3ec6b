"""What a pipeline stage did and held: its compute actions timed as they ran, and the activations each one kept.

    trace = StageTrace()
    trace.watch(stage)                # a torch PipelineStage: its forward/backward methods are timed from now on
    trace.watch_loss(schedule)        # the last stage's loss forward counts as part of its F
    ... schedule.step(...) ...
    trace.take()                      # [["F", stage, mb, t0, t1, bytes_saved], ["B", ...], ...] since the last take
    bubble_fractions({0: actions_of_rank0, 1: actions_of_rank1})   # idle / makespan, per rank
    in_flight(actions)                # {stage: (most microbatches held at once, most bytes held at once)}
    idle_split(by_rank)               # {rank: (waiting for a peer's compute, idle between actions)}: the bubble's parts
    message_waits(by_rank)            # [(rank, action, seconds it waited for a message once its input was computed)]

Why wrap the stage's methods rather than read the schedule's order: the order a schedule *plans*
(`pipeline_order`) reproduces the bubble formula by construction, since it is built from unit-time slots. What
the ranks really did is when each forward and backward started and ended, which the stage's own
`forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk` bracket exactly; waiting for a peer's
activations or gradients happens between them, so it counts as idle, as it should. The loss is computed by the
schedule right after the last stage's forward (`_maybe_compute_loss`), outside forward_one_chunk: `watch_loss`
extends that F to the loss's end, so that the loss counts as the last stage's compute, as it does in one process
(its backward is already inside that stage's B). (torch also labels each
action for the profiler, record_function "Forward i" / "PP:<action>", but a profiler's cost on every op would
distort what it measures.) Times are time.perf_counter(), which is one clock for every process of a machine.

Action kinds: "F" forward, "B" full backward (inputs and weights), "I" backward for the inputs only and "W" for
the weights only (the zero-bubble schedules split B into I and W to fill the bubble with W).

Activations: the bytes of the tensors autograd saved during each forward (held.SavedTensors: parameters and
their views excepted, each storage once, those still held when the forward returns). A microbatch's are held from its F until its B
(or its W, when split).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from .held import SavedTensors

Action = list  # [kind, stage, microbatch, t0, t1, bytes saved (F only, else 0)]


class StageTrace:
    """Times the compute actions of the stages it watches, and measures the activations each forward saved."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.current: str = ""
        """The action running now, or the last one finished ("after F3 of stage 1"): a hang report names it."""
        self.on_change: Any = None
        """Called with `current` each time it changes (pipestep keeps it in a file the launcher can read)."""

    def watch(self, stage: Any) -> None:
        """Time `stage`'s compute from now on (wraps three of its methods, on this instance only)."""
        index = stage.stage_index
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            with self._action("F", index, mb) as row, SavedTensors() as saved:
                out = forward(mb, *args, **kwargs)
            row[5] = saved.bytes()
            return out

        def backward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            with self._action("B" if full else "I", index, mb):
                return backward(mb, *args, **kwargs)

        def backward_weight_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            with self._action("W", index, mb):
                return weight(mb, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def watch_loss(self, schedule: Any) -> None:
        """Count the loss the schedule computes after each forward of the last stage as part of that F (wraps
        the schedule's `_maybe_compute_loss`, on this instance only; torch 2.9 to 2.13 call it right after
        forward_one_chunk in every schedule)."""
        compute = schedule._maybe_compute_loss

        def _maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb: int, *args: Any, **kwargs: Any) -> Any:
            row = self.actions[-1] if self.actions else None
            if not (stage.is_last and row and row[:3] == ["F", stage.stage_index, mb]):
                return compute(stage, output, target_mbs, mb, *args, **kwargs)
            with SavedTensors() as saved:
                out = compute(stage, output, target_mbs, mb, *args, **kwargs)
            row[4], row[5] = time.perf_counter(), row[5] + saved.bytes()
            return out

        schedule._maybe_compute_loss = _maybe_compute_loss

    def note(self, text: str) -> None:
        self.current = text
        if self.on_change is not None:
            self.on_change(text)

    def take(self) -> list[Action]:
        out, self.actions = self.actions, []
        return out

    def _action(self, kind: str, stage: int, mb: int) -> "_Timed":
        return _Timed(self, [kind, stage, mb, 0.0, 0.0, 0])


class _Timed:
    def __init__(self, trace: StageTrace, row: Action):
        self.trace, self.row = trace, row

    def __enter__(self) -> Action:
        kind, stage, mb = self.row[:3]
        self.trace.note(f"in {kind}{mb} of stage {stage}")
        self.row[3] = time.perf_counter()
        return self.row

    def __exit__(self, *exc: Any) -> None:
        self.row[4] = time.perf_counter()
        kind, stage, mb = self.row[:3]
        if exc[0] is None:
            self.trace.note(f"after {kind}{mb} of stage {stage} (then waiting, or in the next action)")
        self.trace.actions.append(self.row)


def busy_s(actions: list[Action]) -> float:
    """Seconds this rank spent computing (the sum of its actions' durations)."""
    return sum(a[4] - a[3] for a in actions)


def bubble_fractions(by_rank: dict[int, list[Action]]) -> dict[int, float]:
    """Idle time over total time, per rank, for one step: total is the pipeline's makespan, from the first action's
    start on any rank to the last action's end on any rank; idle is what of it the rank did not compute.

        bubble_fractions({0: [["F", 0, 0, 0.0, 1.0, 0]], 1: [["F", 1, 0, 1.0, 2.0, 0]]})   # {0: 0.5, 1: 0.5}
    """
    rows = [a for actions in by_rank.values() for a in actions]
    if not rows:
        return {}
    start, end = min(a[3] for a in rows), max(a[4] for a in rows)
    return {rank: 1.0 - busy_s(actions) / (end - start) for rank, actions in by_rank.items()}


def idle_split(by_rank: dict[int, list[Action]]) -> dict[int, tuple[float, float]]:
    """{rank: (waiting, between)}, each a fraction of the step's makespan, adding up to the rank's bubble:
    waiting: idle while what its next action needs was still being computed on another rank (and before its first
        action, after its last): the part the schedule's order causes, which the formulas count;
    between: the rest of its idle, from the moment its next action could have started on what was computed to the
        moment it did: the message in flight, and the schedule's own work between actions (posting a receive,
        starting a send, looking up the loss), which the formulas leave out.

        idle_split({0: [["F", 0, 0, 0.0, 1.0, 0], ["B", 0, 0, 3.5, 4.5, 0]],
                    1: [["F", 1, 0, 1.5, 2.5, 0], ["B", 1, 0, 2.5, 3.0, 0]]})
        # of the 4.5 s makespan: {0: (2/4.5, 0.5/4.5), 1: (2.5/4.5, 0.5/4.5)}; rank 1 waited for rank 0's F (1 s)
        # and, after its B, for rank 0's B (1.5 s); each rank lost 0.5 s to a message
    """
    rows = [a for actions in by_rank.values() for a in actions]
    if not rows:
        return {}
    start, end = min(a[3] for a in rows), max(a[4] for a in rows)
    made = _producers(by_rank)
    out = {}
    for rank, actions in by_rank.items():
        waiting = between = 0.0
        free = start
        for action in sorted(actions, key=lambda a: a[3]):
            source = made.get(_needs(action))
            ready = max(free, source[1][4]) if source is not None else free
            waiting += min(action[3], ready) - free
            between += max(0.0, action[3] - ready)
            free = action[4]
        span = end - start
        out[rank] = ((waiting + end - free) / span, between / span)
    return out


def message_waits(by_rank: dict[int, list[Action]]) -> list[tuple[int, str, float]]:
    """[(rank, action, seconds)]: for each action that needed another rank's output (F of stage s needs the F of
    s - 1, B or I of stage s the B or I of s + 1), how long after both that output was computed and its own rank
    was free it started: one message's time, as the pipeline paid it (torch posts each receive just before the
    action that needs it, and gloo moves the data only once the receive is posted), plus the schedule's work
    between the two actions.

        message_waits({0: [["F", 0, 0, 0.0, 1.0, 0]], 1: [["F", 1, 0, 1.3, 2.0, 0]]})   # [(1, "F0 of stage 1", 0.3)]
    """
    made = _producers(by_rank)
    out = []
    for rank, actions in by_rank.items():
        free = None
        for action in sorted(actions, key=lambda a: a[3]):
            source = made.get(_needs(action))
            if source is not None and source[0] != rank:
                ready = source[1][4] if free is None else max(free, source[1][4])
                out.append((rank, f"{action[0]}{action[2]} of stage {action[1]}", action[3] - ready))
            free = action[4]
    return out


def _needs(action: Action) -> tuple | None:
    """The action whose output `action` takes in: F of stage s the F of s - 1, B or I of s the B or I of s + 1."""
    kind, stage, mb = action[:3]
    return ("F", stage - 1, mb) if kind == "F" else ("B", stage + 1, mb) if kind in ("B", "I") else None


def _producers(by_rank: dict[int, list[Action]]) -> dict[tuple, tuple[int, Action]]:
    """{("F" or "B", stage, microbatch): (rank, action)}: an I is keyed as the B it replaces (it sends the same)."""
    return {("F" if a[0] == "F" else "B", a[1], a[2]): (rank, a) for rank, actions in by_rank.items()
            for a in actions if a[0] != "W"}


def step_summary(by_rank: dict[int, list[Action]]) -> dict[str, float]:
    """One step's bubble in numbers (fractions of its makespan, times in seconds):
    bubble: that of the slowest stage's rank (the one that computed longest), whose pace the pipeline runs at;
    between: the part of it spent between actions (idle_split: messages, the schedule's own work);
    mean: the bubble averaged over the ranks; imbalance: mean - bubble, what the faster ranks idle on top;
    wait_s: the median message wait (message_waits); f_s: the median forward action.

        step_summary({0: [["F", 0, 0, 0.0, 1.0, 0]], 1: [["F", 1, 0, 1.5, 3.0, 0]]})["bubble"]   # 0.5 (rank 1)
    """
    fractions, split = bubble_fractions(by_rank), idle_split(by_rank)
    slowest = max(by_rank, key=lambda r: busy_s(by_rank[r]))
    mean = sum(fractions.values()) / len(fractions)
    waits = sorted(w for _, _, w in message_waits(by_rank))
    forwards = sorted(a[4] - a[3] for actions in by_rank.values() for a in actions if a[0] == "F")
    return {"bubble": fractions[slowest], "between": split[slowest][1], "mean": mean,
            "imbalance": mean - fractions[slowest], "wait_s": _median(waits), "f_s": _median(forwards)}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """The bubble of GPipe and 1F1B with equal stages: (p - 1) / (m + p - 1) of each rank's time is idle."""
    return (stages - 1) / (microbatches + stages - 1)


def interleaved_bubble(ranks: int, microbatches: int, stages_per_rank: int) -> float:
    """Interleaved 1F1B (Narayanan et al. 2021), in the same idle-over-total terms: (p - 1) / (v m + p - 1),
    p ranks each holding v stages (each 1/v of the work): the ramp is p - 1 chunks of 1/v of a microbatch each."""
    return (ranks - 1) / (stages_per_rank * microbatches + ranks - 1)


def in_flight(actions: list[Action]) -> dict[int, tuple[int, int]]:
    """{stage: (most microbatches whose activations were held at once, most bytes held at once)}, replaying the
    actions in the order they started: a microbatch is held from its F until its B, or its W when split.

        in_flight([["F", 0, 0, 0, 1, 8], ["F", 0, 1, 1, 2, 8], ["B", 0, 0, 2, 3, 0]])   # {0: (2, 16)}
    """
    held: dict[int, dict[int, int]] = {}
    most: dict[int, tuple[int, int]] = {}
    for kind, stage, mb, *_, saved in sorted(actions, key=lambda a: a[3]):
        now = held.setdefault(stage, {})
        if kind == "F":
            now[mb] = saved
        elif kind in ("B", "W"):
            now.pop(mb, None)
        count, size = most.get(stage, (0, 0))
        most[stage] = (max(count, len(now)), max(size, sum(now.values())))
    return most
