"""Build the MoE all-to-all yourself: dispatch each token to the rank that owns its expert, then combine the
experts' outputs back in the tokens' order, checked on 2 and 3 gloo ranks.

    def dispatch(tokens, expert_of_token, n_experts):   # tokens [T, H], expert_of_token [T]: one expert per row
        ...                                            # -> (rows for my experts, plan: what combine needs)
    def combine(processed, plan):                      # processed: the received rows, each after its expert
        ...                                            # -> [T, H], row i the output for this rank's token i
    report = check_a2a(dispatch, combine)
    dispatch, combine = report.use(a2a_reference)      # yours if they passed

Expert e lives on rank e // (n_experts // world_size). The rows a rank receives may come in any order: the
checker's experts read which expert a row is for from the row itself (column 0 holds it), and multiply it by
1 + expert. Row i of combine's result must be this rank's token i times 1 + its expert.

What is checked, on every rank, against what the rows must be (any collectives may be used: all_to_all_single,
all_gather, send/recv; only the rows that arrive and come back are judged):
    runs        every rank finished (a raise names the rank, the function, dispatch or combine, and its line; a
                hang each rank's place)
    probes      "even": every rank sends every rank the same number of rows (received counts equal sent ones);
                "uneven": each rank holds a different number of tokens and one expert gets none (2 and 3 ranks)
    dispatch    each rank received exactly the rows meant for its experts; combine runs only once dispatch was
                right on every rank, so that a failure in combine is blamed on combine
    combine     each rank got every token's output back in its own row
    mistakes    told apart: right on "even" and broken on "uneven" in dispatch (the sizes received were not the
                ones sent: the split sizes were not exchanged first) or in combine (the reverse exchange's sizes
                not swapped); rows missing or foreign at a rank after dispatch; every row back but in another
                order after combine (the sort by expert was not undone)
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..run import RankFailure, launch
from .learner import learner_part, read_error, report_failure
from .report import Report

HIDDEN = 4       # columns: expert, source rank, position, a random value


def a2a_dispatch(tokens: torch.Tensor, expert_of_token: torch.Tensor, n_experts: int):
    """The reference dispatch: sort rows by expert, trade the counts, then one all_to_all_single of the rows."""
    world = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)
    send = torch.bincount(expert_of_token, minlength=n_experts).view(world, -1).sum(1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)                      # split sizes first: one number per rank
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    received = tokens.new_empty(sum(recv_sizes), tokens.shape[1])
    dist.all_to_all_single(received, tokens[order], recv_sizes, send_sizes)
    return received, (order, send_sizes, recv_sizes)


def a2a_combine(processed: torch.Tensor, plan: Any) -> torch.Tensor:
    """The reference combine: the same exchange reversed, then undo the sort."""
    order, send_sizes, recv_sizes = plan
    back = processed.new_empty(sum(send_sizes), processed.shape[1])
    dist.all_to_all_single(back, processed, send_sizes, recv_sizes)
    out = torch.empty_like(back)
    out[order] = back
    return out


class Pair:
    """A dispatch and its combine: what check_a2a checks and report.use hands back (unpack it)."""

    def __init__(self, dispatch: Callable, combine: Callable):
        self.dispatch, self.combine = dispatch, combine
        self.names = getattr(dispatch, "__name__", "dispatch"), getattr(combine, "__name__", "combine")
        self.__name__ = " and ".join(self.names)

    def __iter__(self):
        return iter((self.dispatch, self.combine))

    def __eq__(self, other: Any) -> bool:
        return tuple(self) == tuple(other)

    def __repr__(self) -> str:
        return self.__name__


a2a_reference = Pair(a2a_dispatch, a2a_combine)


def probe_tokens(probe: str, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens [T, HIDDEN], expert_of_token [T], n_experts) of `rank` in `probe`; every rank can make every rank's."""
    n_experts, per_rank = 2 * world, 2
    gen = torch.Generator().manual_seed(100 * world + rank + (0 if probe == "even" else 50))
    if probe == "even":      # 3 rows for each rank's experts: sent counts equal received counts everywhere
        owner = torch.arange(world).repeat_interleave(3)
        expert = owner * per_rank + torch.randint(per_rank, owner.shape, generator=gen)
    else:                    # 4 + 3*rank tokens; the last expert gets none
        expert = torch.randint(n_experts - 1, (4 + 3 * rank,), generator=gen)
    expert = expert[torch.randperm(len(expert), generator=gen)]
    tokens = torch.stack([expert.float(), torch.full_like(expert, rank).float(), torch.arange(len(expert)).float(),
                          torch.rand(len(expert), generator=gen)], 1)
    return tokens, expert, n_experts


def _keys(rows: torch.Tensor) -> list[tuple[float, ...]]:
    return sorted(tuple(round(v, 5) for v in row) for row in rows.tolist())


def _any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (the checker's own all-reduce, outside the learner's code)."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _judge_dispatch(received: Any, want: torch.Tensor, every: torch.Tensor) -> dict[str, Any]:
    if not isinstance(received, torch.Tensor) or received.dim() != 2 or received.shape[1] != want.shape[1]:
        shape = list(received.shape) if isinstance(received, torch.Tensor) else type(received).__name__
        return {"rows": 0, "expected": len(want), "lost": len(want), "foreign": 0, "alien": 0, "shape": shape,
                "ok": False}
    got, expected = _keys(received.detach().float()), _keys(want)
    lost = len([k for k in expected if k not in got])
    foreign = len([k for k in got if k not in expected])
    tokens = set(_keys(every))
    return {"rows": len(got), "expected": len(expected), "lost": lost, "foreign": foreign,
            "alien": len([k for k in got if k not in tokens]),
            "shape": list(received.shape), "ok": not lost and not foreign and len(got) == len(expected)}


def _judge_combine(back: Any, right: torch.Tensor) -> dict[str, Any]:
    shaped = isinstance(back, torch.Tensor) and tuple(back.shape) == tuple(right.shape)
    back_rows = _keys(back.detach().float()) if isinstance(back, torch.Tensor) and back.dim() == 2 else []
    present = len([k for k in _keys(right) if k in back_rows])
    return {"combined": bool(shaped and torch.allclose(back.detach().float(), right)),
            "reordered": bool(shaped and back_rows == _keys(right)), "present": present, "tokens": len(right),
            "shape": list(back.shape) if isinstance(back, torch.Tensor) else type(back).__name__}


def drive_a2a(ctx: Any, pair: Pair) -> dict[str, Any]:
    """On each rank, each probe: the learner's dispatch, judged; then (only if dispatch was right on every rank) the
    checker's experts and the learner's combine, judged. Each verdict is written down as soon as it is made, so that
    a run that fails later still says which steps were right."""
    out: dict[str, Any] = {"rank": ctx.rank}
    for probe in ("even", "uneven"):
        tokens, expert, n_experts = probe_tokens(probe, ctx.rank, ctx.world_size)
        mine = range(ctx.rank * 2, ctx.rank * 2 + 2)
        everyone = [probe_tokens(probe, r, ctx.world_size) for r in range(ctx.world_size)]
        want = torch.cat([t[torch.isin(e, torch.tensor(list(mine)))] for t, e, _ in everyone])
        with learner_part(ctx, pair.names[0]):
            received, plan = pair.dispatch(tokens.clone(), expert.clone(), n_experts)
        result = _judge_dispatch(received, want, torch.cat([t for t, _, _ in everyone]))
        out[probe] = result
        Path(ctx.run_dir, f"a2a_{probe}_dispatch{ctx.rank}.json").write_text(json.dumps(result))
        if _any_rank(not result["ok"]):
            return out
        processed = received.detach() * (1 + received.detach()[:, :1])   # the checker's experts
        with learner_part(ctx, pair.names[1]):
            back = pair.combine(processed, plan)
        result.update(_judge_combine(back, tokens * (1 + expert[:, None].float())))
        Path(ctx.run_dir, f"a2a_{probe}_combine{ctx.rank}.json").write_text(json.dumps(result))
        if _any_rank(not result["combined"]):
            return out
    return out


STEPS = (("even", "dispatch"), ("even", "combine"), ("uneven", "dispatch"), ("uneven", "combine"))


def _broken_step(run_dir: Path, world: int) -> tuple[str, str]:
    """(probe, step) of a failed run where some rank did not finish: the first step whose verdict is not written
    down on every rank (a step judged wrong ends the run without a failure, so the steps before it were right)."""
    return next(((probe, step) for probe, step in STEPS
                 if not all(Path(run_dir, f"a2a_{probe}_{step}{r}.json").exists() for r in range(world))), STEPS[-1])


def _failed_run(report: Report, failure: RankFailure, world: int, names: tuple[str, str]) -> None:
    """A run that raised, crashed or hung: which function (the error file, the learner's frame, or each rank's
    place), and, when dispatch or combine was right on "even" and broke on "uneven", the cause that tells those
    apart: the sizes of an exchange."""
    report_failure(report, failure)
    error = read_error(failure.run_dir)
    if error and error["type"] == "NotImplementedError":
        return
    probe, step = _broken_step(failure.run_dir, world)
    if probe == "even" or (error and error["part"] not in names):
        return
    if step == "dispatch":
        report.add("split sizes", "fail", f"dispatch is right when every rank receives as many rows as it sends "
                   f"('even'), and broke on {world} ranks when the numbers differ ('uneven'): it must not assume "
                   "that a rank receives what it sends. Each rank first tells every other how many rows it will "
                   "send (an all_to_all_single of one count per rank), and sizes its receive buffer and "
                   "output_split_sizes from those counts", part=names[0])
    else:
        report.add("split sizes", "fail", f"dispatch was right on every probe, and combine right when every rank "
                   f"receives as many rows as it sends ('even'), but combine broke on {world} ranks when the numbers "
                   "differ ('uneven'): it must not assume that a rank gets back what it sent. The reverse exchange "
                   "swaps dispatch's sizes (what came in from each rank goes back to it: output_split_sizes = the "
                   "counts this rank sent, input_split_sizes = the counts it received)", part=names[1])


def check_a2a(dispatch: Callable, combine: Callable, *, worlds: tuple[int, ...] = (2, 3), timeout: float = 20.0,
              runs_root: Any = None) -> Report:
    """Run dispatch and combine on each world size of `worlds` and say what is right and wrong with them:
    check_a2a(a2a_dispatch, a2a_combine).ok."""
    pair = Pair(dispatch, combine)
    report = Report(f"{pair.__name__}: MoE all-to-all on {' and '.join(map(str, worlds))} gloo ranks",
                    implementation=pair)
    results: dict[int, list[dict[str, Any]]] = {}
    for world in worlds:
        try:
            run = launch(functools.partial(drive_a2a, pair=pair), world_size=world, timeout=timeout, echo=False,
                         progress=False, name=f"check-a2a-w{world}", runs_root=runs_root)
        except RankFailure as failure:
            _failed_run(report, failure, world, pair.names)
            return report
        report.run_dir = run.path
        results[world] = [run.result(r) for r in range(world)]
        if not all(r.get(p, {}).get("combined") for r in results[world] for p in ("even", "uneven")):
            break        # judged below; the next world size would tell nothing more
    report.add("runs", "pass", f"every rank finished on {' and '.join(map(str, worlds))} ranks")
    cases = [(w, r["rank"], p, r[p]) for w, got in results.items() for r in got for p in ("even", "uneven")
             if p in r]
    report.measured["rows_checked"] = sum(c["expected"] for *_, c in cases)
    bad = [(w, r, p, c) for w, r, p, c in cases if not c["ok"]]
    if bad:
        w, r, p, c = bad[0]
        if c["rows"] == 0 and c["lost"] and c["shape"] != [0, HIDDEN]:
            said = f"returned {c['shape']} as its rows, where {c['expected']} rows of [T, {HIDDEN}] were meant"
        else:
            said = (f"received {c['rows']} rows where {c['expected']} were meant for its experts "
                    f"({c['lost']} of those missing, {c['foreign']} not meant for it)")
        if c["alien"]:
            hint = (f" {c['alien']} of the rows it returned are no rank's tokens at all: what dispatch returns must be "
                    "the rows it received from the other ranks")
        elif c["rows"] == c["expected"]:
            hint = (" The number of rows was right but not the rows: all_to_all_single sends consecutive chunks, one "
                    "per rank, so the rows must be sorted by expert (so by owner rank) before they are sent")
        else:
            hint = ""
        report.add("dispatch", "fail", f"tokens lost: on {w} ranks ({p}), rank {r} {said}. Each row must reach the "
                   "rank owning its expert (expert e on rank e // (n_experts // world_size))." + hint,
                   part=pair.names[0])
        return report
    report.add("dispatch", "pass", f"every rank received exactly the rows meant for its experts "
               f"({report.measured['rows_checked']} rows in all)")
    wrong = [(w, r, p, c) for w, r, p, c in cases if not c.get("combined")]
    if not wrong:
        report.add("combine", "pass", "every token came back to its own row, on every rank")
        return report
    w, r, p, c = wrong[0]
    if c["reordered"]:
        report.add("combine", "fail", f"wrong order on combine: on {w} ranks ({p}), rank {r} got every token's "
                   "output back but not in its tokens' order. The rows went out sorted by expert: put each back "
                   "where it came from (out[order] = back), with the order dispatch handed over in its plan",
                   part=pair.names[1])
    else:
        report.add("combine", "fail", f"tokens lost on combine: on {w} ranks ({p}), rank {r} got back a result of "
                   f"shape {tuple(c['shape']) if isinstance(c['shape'], list) else c['shape']}, expected "
                   f"({c['tokens']}, {HIDDEN}), holding {c['present']} of its {c['tokens']} tokens' outputs "
                   "(anywhere). Send each processed row back to the rank it came from (the reverse of dispatch's "
                   "exchange, with the split sizes swapped)", part=pair.names[1])
    return report
