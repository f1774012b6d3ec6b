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

What is checked, on every rank, against what the rows must be:
    runs        every rank finished (a collective with sizes the ranks disagree on aborts or hangs: reported)
    probes      "even": every rank sends every rank the same number of rows (received counts equal sent ones);
                "uneven": each rank holds a different number of tokens and one expert gets none (2 and 3 ranks)
    mistakes    told apart: right on "even" and broken on "uneven" (the split sizes were not exchanged first);
                rows missing or foreign at a rank after dispatch (tokens lost); every row back but in another
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
        self.__name__ = f"{getattr(dispatch, '__name__', 'dispatch')} and {getattr(combine, '__name__', 'combine')}"

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


def drive_a2a(ctx: Any, pair: Pair) -> dict[str, Any]:
    """On each rank, each probe: the learner's dispatch, the checker's experts, the learner's combine, judged."""
    out: dict[str, Any] = {"rank": ctx.rank}
    for probe in ("even", "uneven"):
        tokens, expert, n_experts = probe_tokens(probe, ctx.rank, ctx.world_size)
        mine = range(ctx.rank * 2, ctx.rank * 2 + 2)
        want = torch.cat([t[torch.isin(e, torch.tensor(list(mine)))] for t, e, _ in
                          (probe_tokens(probe, r, ctx.world_size) for r in range(ctx.world_size))])
        with learner_part(ctx, "dispatch"):
            received, plan = pair.dispatch(tokens.clone(), expert.clone(), n_experts)
        got, expected = _keys(received.detach()), _keys(want)
        lost = len([k for k in expected if k not in got])
        foreign = len([k for k in got if k not in expected])
        processed = received.detach() * (1 + received.detach()[:, :1])   # the checker's experts
        with learner_part(ctx, "combine"):
            back = pair.combine(processed, plan)
        right = tokens * (1 + expert[:, None].float())
        shaped = tuple(back.shape) == tuple(right.shape)
        result = {"rows": len(got), "expected": len(expected), "lost": lost, "foreign": foreign,
                  "combined": bool(shaped and torch.allclose(back, right)),
                  "reordered": bool(shaped and _keys(back) == _keys(right)), "shape": list(back.shape)}
        out[probe] = result
        Path(ctx.run_dir, f"a2a_{probe}{ctx.rank}.json").write_text(json.dumps(result))
    return out


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
            even = [Path(failure.run_dir, f"a2a_even{r}.json") for r in range(world)]
            passed_even = all(p.exists() and json.loads(p.read_text())["combined"] for p in even)
            error = read_error(failure.run_dir)
            if passed_even and (error is None or error["type"] != "NotImplementedError"):
                report.run_dir = failure.run_dir
                report.add("split sizes", "fail", f"right when every rank sends each rank the same number of rows, "
                           f"broken on {world} ranks when the numbers differ (rank {failure.rank}: "
                           f"{failure.reason}): the split sizes were not exchanged. Each rank must first tell every "
                           "other how many rows it will send (an all_to_all_single of one count per rank), and pass "
                           "those counts as output_split_sizes")
            else:
                report_failure(report, failure)
            return report
        report.run_dir = run.path
        results[world] = [run.result(r) for r in range(world)]
    report.add("runs", "pass", f"every rank finished on {' and '.join(map(str, worlds))} ranks")
    cases = [(w, r["rank"], p, r[p]) for w, got in results.items() for r in got for p in ("even", "uneven")]
    report.measured["rows_checked"] = sum(c["expected"] for *_, c in cases)
    bad = [(w, r, p, c) for w, r, p, c in cases if c["lost"] or c["foreign"]]
    if bad:
        w, r, p, c = bad[0]
        report.add("dispatch", "fail", f"tokens lost: on {w} ranks ({p}), rank {r} received {c['rows']} rows where "
                   f"{c['expected']} were meant for its experts ({c['lost']} missing, {c['foreign']} not its own). "
                   "Sort the rows by expert before sending: all_to_all_single sends them in chunks, one per rank")
        return report
    report.add("dispatch", "pass", f"every rank received exactly the rows meant for its experts "
               f"({report.measured['rows_checked']} rows in all)")
    wrong = [(w, r, p, c) for w, r, p, c in cases if not c["combined"]]
    if not wrong:
        report.add("combine", "pass", "every token came back to its own row, on every rank")
        return report
    w, r, p, c = wrong[0]
    if all(c["reordered"] for *_, c in wrong):
        report.add("combine", "fail", f"wrong order on combine: on {w} ranks ({p}), rank {r} got every row back but "
                   "not in its tokens' order. The rows went out sorted by expert: put each back where it came "
                   "from (out[order] = back)")
    else:
        report.add("combine", "fail", f"tokens lost on combine: on {w} ranks ({p}), rank {r} got back a result of "
                   f"shape {tuple(c['shape'])} whose rows are not its tokens' outputs. Send the processed rows back "
                   "with the split sizes swapped: what came in from each rank goes back to it")
    return report
