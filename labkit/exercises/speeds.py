"""Time DDP wrappers side by side on a real model: step time, backward, exposed communication, a timeline.

    run = time_wrappers({"naive": NaiveDDP, "overlap": OverlapDDP,
                         "torch DDP": functools.partial(TorchDDP, bucket_size_mb=25)}, steps=10)
    timing_table(run)            # one row per wrapper: medians over steps of the slowest rank
    messages(run, "naive")       # {step: bytes of each all-reduce, in launch order}, as counted on rank 0
    packing_problems(step_bytes, cap=2**20, largest_gradient=...)   # more or bigger messages than buckets need
    timeline(run, step=5)        # labkit.exercises.charts: backward and each all-reduce, per wrapper

Every wrapper gets the same tiny GPT-2 (labkit's tinylm task, the same seed) and the same batches; the wrappers
take turns step by step, so noise from the rest of the machine hits them alike. Each step records, per rank:
the step, backward and finish_gradient_synchronization() times, the collectives (CommProbe: bytes, start, end,
relative to backward's start) and the loss. torch's DDP runs behind the same interface (TorchDDP), with a comm
hook that makes its all-reduces visible to the probe.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..records import Run
from ..run import launch
from ..training.tasks import make_task
from .probe import CommProbe


def _watched_allreduce(_, bucket):  # noqa: ANN001, ANN202 - DDP rejects hooks whose annotations are strings
    """DDP's plain all-reduce, made through dist.all_reduce (so that CommProbe sees it)."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


class TorchDDP(nn.Module):
    """torch's DistributedDataParallel behind the exercises' interface:  TorchDDP(model, bucket_size_mb=25)."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        super().__init__()
        self.ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_size_mb)
        self.ddp.register_comm_hook(None, _watched_allreduce)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: DDP's backward returns once every bucket's all-reduce has finished."""


def tinylm_config(world_size: int, model_size: str = "small", global_batch: int = 16) -> RunConfig:
    """The tinylm run the timing and ZeRO lessons train (records off: they record themselves)."""
    return RunConfig(task="tinylm", model_size=model_size, world_size=world_size, global_batch=global_batch,
                     tensorboard=False, save_final=False)


def time_wrappers(wrappers: dict[str, Callable[[nn.Module], nn.Module]], *, steps: int = 10, world_size: int = 2,
                  model_size: str = "small", global_batch: int = 16, runs_root: Any = None,
                  timeout: float = 120.0) -> Run:
    """Train one model per wrapper, in turns, on `world_size` ranks; one record per (wrapper, step, rank)."""
    config = tinylm_config(world_size, model_size, global_batch)
    worker = functools.partial(_time_rank, wrappers=wrappers, steps=steps, config=config)
    return launch(worker, world_size=world_size, timeout=timeout, echo=False, progress=False,
                  name="time-wrappers", runs_root=runs_root)


def _time_rank(ctx: Any, wrappers: dict[str, Callable[[nn.Module], nn.Module]], steps: int,
               config: RunConfig) -> None:
    task = make_task(config, ctx.world_size)
    models = {}
    with CommProbe() as probe:
        for label, wrap in wrappers.items():
            torch.manual_seed(config.seed)
            model = task.build_model()
            models[label] = (wrap(model), torch.optim.AdamW(model.parameters(), lr=config.lr))
        row = 0
        for step in range(steps):
            for label, (wrapped, optimizer) in models.items():
                started = time.perf_counter()
                loss, _ = task.loss(wrapped, *task.batch(step, 0, ctx.rank))
                with probe.phase("backward", row):
                    backward_start = time.perf_counter()
                    loss.backward()
                    backward_end = time.perf_counter()
                with probe.phase("finish", row):
                    wrapped.finish_gradient_synchronization()
                finish_end = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                ctx.record(row, label=label, step_of=step, loss=loss.item(), samples=task.batch_size,
                           t_step=time.perf_counter() - started, t_backward=backward_end - backward_start,
                           t_exposed=finish_end - backward_end,
                           **_communication(probe.of(step=row), backward_start, backward_end))
                row += 1
        with probe.paused():
            dist.barrier()


def _communication(events: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """A step's collectives: how many, bytes, when the first started (fraction of backward), the share of bytes
    launched before backward ended, and each one's [start, end, bytes] in seconds from backward's start."""
    if not events:
        return {"allreduces": 0, "comm_bytes": 0, "first_launch": float("nan"), "overlap_fraction": 0.0,
                "timeline": []}
    total = sum(e["bytes"] for e in events)
    first = min(e["start"] for e in events)
    return {"allreduces": len(events), "comm_bytes": total, "first_launch": (first - start) / (end - start),
            "overlap_fraction": sum(e["bytes"] for e in events if e["start"] < end) / total,
            "timeline": [[e["start"] - start, (e["end"] or e["start"]) - start, e["bytes"]] for e in events]}


def timing_table(run: Run, warm: int = 2) -> pd.DataFrame:
    """One row per wrapper, from step `warm` on: medians over steps of the slowest rank's times (ms), all-reduces
    and bytes per step, when the first all-reduce started (fraction of backward), share of bytes sent during it."""
    df = run.df[run.df.step_of >= warm]
    per_step = df.groupby(["label", "step_of"], sort=False).agg(
        t_step=("t_step", "max"), t_backward=("t_backward", "max"), t_exposed=("t_exposed", "max"),
        allreduces=("allreduces", "max"), comm_bytes=("comm_bytes", "max"),
        first_launch=("first_launch", "median"), overlap_fraction=("overlap_fraction", "min"))
    table = per_step.groupby("label", sort=False).median()
    for column in ("t_step", "t_backward", "t_exposed"):
        table[f"{column[2:]} ms"] = table.pop(column) * 1e3
    return table


def loss_gap(run: Run, reference: str) -> float:
    """Largest difference, over steps and ranks, between each wrapper's loss and `reference`'s loss."""
    losses = run.df.pivot_table(index=["step_of", "rank"], columns="label", values="loss")
    return 0.0 if losses.empty else float(losses.sub(losses[reference], axis=0).abs().max().max())


def messages(run: Run, label: str, warm: int = 2, rank: int = 0) -> dict[int, list[int]]:
    """{step: bytes of each all-reduce the wrapper `label` launched, in launch order}, from step `warm` on, as the
    probe counted them on `rank`:  messages(run, "yours 1.0 MB")[5] -> [1048320, 1048576, 1167360]."""
    df = run.df[(run.df.label == label) & (run.df.step_of >= warm) & (run.df["rank"] == rank)]
    if df.empty:
        raise KeyError(f"no steps of {label!r} from step {warm} on; wrappers timed: {sorted(run.df.label.unique())}")
    return {int(row.step_of): [int(e[2]) for e in sorted(row.timeline, key=lambda e: e[0])]
            for row in df.itertuples()}


def packing_problems(step_bytes: list[int], cap: float, largest_gradient: int) -> list[str]:
    """What makes one step's messages (bytes, in launch order) more or larger than buckets of at most `cap` bytes,
    filled in backward's order, need to be: a message over the cap (unless one gradient alone is larger), or two
    consecutive messages that would have fit in one bucket. [] when there is nothing wrong."""
    problems = [f"message {i} carries {b:,} B, over the cap of {cap:,.0f} B" for i, b in enumerate(step_bytes)
                if b > max(cap, largest_gradient)]
    problems += [f"messages {i} and {i + 1} ({a:,} + {b:,} B) would have fit in one bucket of {cap:,.0f} B"
                 for i, (a, b) in enumerate(zip(step_bytes, step_bytes[1:])) if a + b <= cap]
    return problems


# The bucket sweep's claims (lesson 16), one function per claim: each returns (holds, what was measured).

def fewer_messages_as_buckets_grow(sweep: pd.DataFrame, implementation: str) -> tuple[bool, str]:
    """Claim: the all-reduce count falls (never rises) as the bucket grows, down to one message at the largest size."""
    counts = sweep[sweep.implementation == implementation].sort_values("bucket_mb").allreduces.tolist()
    holds = counts == sorted(counts, reverse=True) and counts[0] > counts[-1] == 1
    return holds, f"all-reduces per step from the smallest bucket up: {[round(c, 1) for c in counts]}"


def sends_each_byte_once(run: Run, sizes_mb: tuple, model_bytes: int, label: str = "yours",
                         warm: int = 2) -> tuple[bool, str]:
    """Claim: at every bucket size and timed step, the messages add up to one gradient of every trained tensor."""
    sent = {(mb, step): sum(b) for mb in sizes_mb for step, b in messages(run, f"{label} {mb} MB", warm).items()}
    wrong = {key: total for key, total in sent.items() if total != model_bytes}
    return not wrong, f"{len(sent)} steps, {model_bytes:,} B each" + (f"; wrong: {wrong}" if wrong else "")


def packs_tightly(run: Run, sizes_mb: tuple, largest_gradient: int, label: str = "yours",
                  warm: int = 2) -> tuple[bool, str]:
    """Claim: no message over the cap (unless one gradient is larger), no two messages that would fit in one bucket."""
    problems = [f"{mb} MB step {step}: {p}" for mb in sizes_mb
                for step, sent in messages(run, f"{label} {mb} MB", warm).items()
                for p in packing_problems(sent, mb * 2**20, largest_gradient)]
    return not problems, "; ".join(problems[:2]) or f"{len(sizes_mb)} bucket sizes, every timed step"


def torch_overshoots_by_under_a_gradient(sweep: pd.DataFrame, sizes_mb: tuple, model_bytes: int,
                                         largest_gradient: int) -> tuple[bool, str]:
    """Claim: where the cap splits the model, torch DDP's largest message is over the cap by less than one gradient."""
    by_size = sweep.set_index(["implementation", "bucket_mb"])
    largest = {mb: by_size.loc[("torch DDP", mb), "largest message (KiB)"] * 2**10 for mb in sizes_mb
               if mb * 2**20 < model_bytes}
    holds = all(mb * 2**20 < b <= mb * 2**20 + largest_gradient for mb, b in largest.items())
    return holds, ", ".join(f"{mb} MB cap: {b / 2**20:.3f} MB" for mb, b in largest.items())
