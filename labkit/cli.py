"""`python -m labkit ...`: the same training loop from a terminal, alone or under torchrun.

    python -m labkit run config.json                          # launches the ranks itself (like a notebook)
    torchrun --nproc-per-node 2 -m labkit run config.json --run-dir runs/job1
                                                              # one rank per torchrun process (many nodes too:
                                                              # scripts/slurm.sbatch, scripts/pytorchjob.yaml)
    torchrun --nproc-per-node 2 --max-restarts 3 -m labkit run config.json --run-dir runs/job1
                                                              # restarts resume from runs/job1/checkpoints/
    python -m labkit show runs/job1                           # summary table; the failure report if it failed
    python -m labkit compare runs/a runs/b -o ab.png          # the side-by-side figure, to a file

config.json holds RunConfig fields (RunConfig.save writes one); missing fields take their defaults.
Under torchrun the records land in the same layout (runs/<id>/rank<r>.jsonl), so Run/compare read them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from .config import RunConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with a RunConfig JSON file")
    run.add_argument("config", type=Path)
    run.add_argument("--run-dir", type=Path, help="where records go (under torchrun: the same path on every rank)")
    run.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a rank is hung")
    for name, text in (("show", "a run's summary table, and its failure report if it failed"),
                       ("summary", "a run's headline figures as JSON")):
        sub.add_parser(name, help=text).add_argument("run_dir", type=Path)
    compare = sub.add_parser("compare", help="throughput | loss | LR of several runs, side by side, to an image")
    compare.add_argument("run_dirs", type=Path, nargs="+")
    compare.add_argument("-o", "--output", type=Path, required=True, help="image file to write (.png, .svg, .pdf)")
    compare.add_argument("--x", choices=("step", "samples"), default="step")
    compare.add_argument("--smooth", type=int, default=1, help="running mean of throughput over this many steps")
    args = parser.parse_args(argv)
    if args.command in ("show", "summary", "compare"):
        return inspect_runs(args)
    config = RunConfig.load(args.config)
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return run_under_torchrun(config, args.run_dir, args.timeout)
    from .run.launch import launch
    result = launch(config, timeout=args.timeout, runs_root=args.run_dir.parent if args.run_dir else None)
    print(json.dumps(result.summary(), indent=2))
    return 0


def inspect_runs(args: argparse.Namespace) -> int:
    """show / summary / compare: read run directories, print or draw; exit 2 with a sentence if one is missing."""
    from .records import Run
    dirs = args.run_dirs if args.command == "compare" else [args.run_dir]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        print(f"labkit {args.command}: no run directory at {', '.join(missing)}", file=sys.stderr)
        return 2
    runs = [Run(d) for d in dirs]
    if args.command == "summary":
        print(json.dumps(runs[0].summary(), indent=2))
    elif args.command == "show":
        print(describe(runs[0]))
    else:
        from .view.figures import compare_figure
        args.output.parent.mkdir(parents=True, exist_ok=True)
        compare_figure(runs, x=args.x, smooth=args.smooth).savefig(args.output, dpi=100, bbox_inches="tight")
        print(f"wrote {args.output}")
    return 0


def describe(run) -> str:
    """A run as a person reads it in a terminal: what it was, its headline figures, how it ended."""
    import pandas as pd
    summary = run.summary()
    lines = [f"{run.name}  ({run.path})", f"world size {run.world_size}, {summary['steps']} steps recorded"]
    table = pd.Series(summary).drop("steps").map(lambda v: f"{v:.4g}")
    lines += ["", table.to_string(), ""]
    failure = run.failure()
    lines.append(failure if failure else "finished: every rank ended cleanly" if run.finished else
                 "no failure on record, but the run did not record an end (still running, or killed with its launcher)")
    return "\n".join(lines)


def run_under_torchrun(config: RunConfig, run_dir: Path | None, timeout: float) -> int:
    """This process is one rank that torchrun started: join its group, train, record, leave.

    Restarts (torchrun --max-restarts): every attempt's records go to the same run directory, tagged with
    TORCHELASTIC_RESTART_COUNT, and the loop resumes from the newest checkpoint there (RunConfig.checkpoint_every;
    the same command run again later continues the job too). The process group is built on a store of this
    attempt's own (elastic_store): restarted gloo groups built on the agent's shared store failed or hung here."""
    import torch
    import torch.distributed as dist
    from .records import RankRecorder, write_meta, write_tensorboard
    from .run.rank import RankContext, rank_device, resolve_backend
    from .training.loop import train
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world != config.world_size:
        config = config.replace(world_size=world)  # torchrun decides the world; keep the records truthful
    run_dir = run_dir or Path("runs") / f"{config.label}-{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    backend = resolve_backend(config.backend, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    device = rank_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(backend, store=elastic_store(rank, world, timedelta(seconds=timeout)), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    placement = where_ranks_run(rank, local_rank, device)  # every rank joins: one all_gather_object
    if rank == 0 and not (run_dir / "meta.json").exists():  # a restart keeps the first attempt's
        config.save(run_dir / "config.json")
        write_meta(run_dir, name=config.label, world_size=world, start_method="torchrun", **placement)
    recorder = RankRecorder(run_dir, rank)
    ctx = RankContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, device=device,
                      run_dir=run_dir, config=config, recorder=recorder)
    try:
        train(ctx, config)
        end_together(rank, world, run_dir, device)
    except BaseException as exc:
        write_rank_error(run_dir, rank, ctx.step, exc)  # Run.failure() and `labkit show` read it; torchrun reports too
        raise
    finally:
        recorder.close()
        dist.destroy_process_group()
        if config.tensorboard:
            write_tensorboard(run_dir, ranks=[rank])  # each rank converts its own records, after training
    return 0


def elastic_store(rank: int, world: int, timeout: timedelta):
    """The rendezvous store of this attempt: torchrun's TCPStore (MASTER_ADDR:MASTER_PORT) under a prefix of its own.

    torchrun's agent keeps one store for the whole job and tells restarted ranks to reuse it; the process group's
    keys in it do not change between attempts, so a restarted gloo group could read the previous attempt's addresses
    (`connectFullMesh ... Connection refused`) or wait on keys already consumed (a hang): in one probe of 10
    restarts on this 2-core machine (torch 2.13, gloo, plain env:// init), 5 failed that way. Under a prefix per
    attempt (TORCHELASTIC_RESTART_COUNT) the same probe had none fail, and tests/test_resume.py restarts labkit's
    loop 10 times in a row. Without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), rank 0 hosts it."""
    import torch.distributed as dist
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    else:
        base = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"labkit/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)


def where_ranks_run(rank: int, local_rank: int, device) -> dict:
    """Which node, host and device each rank of a torchrun job runs on, for meta.json (collective: every rank calls).

    torchrun numbers the nodes (GROUP_RANK) and the ranks on each node (LOCAL_RANK); global ranks are contiguous
    per node. Written once, by rank 0, so a run read back later says how the job was laid out."""
    import socket
    import torch.distributed as dist
    mine = {"rank": rank, "local_rank": local_rank, "node": int(os.environ.get("GROUP_RANK", 0)),
            "host": socket.gethostname(), "device": str(device)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"nodes": len({r["node"] for r in every}), "ranks": every}


def end_together(rank: int, world: int, run_dir: Path, device) -> None:
    """Wait for every rank to finish training; then rank 0 records the outcome and checks that the run directory
    holds every rank's records (on many nodes it must be a filesystem they all mount)."""
    import torch.distributed as dist
    from .records import write_outcome
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    if rank != 0:
        return
    write_outcome(run_dir, None)
    missing = missing_ranks(run_dir, world)
    if missing:
        print(f"labkit: {run_dir} holds no records of ranks {missing}: they wrote to their own node's disk. Give "
              "--run-dir a path on a filesystem every node mounts (NFS, Lustre, a ReadWriteMany volume).",
              file=sys.stderr)


def missing_ranks(run_dir: Path, world: int) -> list[int]:
    """Ranks of 0..world-1 whose records are not in run_dir:  missing_ranks(Path("runs/job1"), 4) -> [2, 3]."""
    return [r for r in range(world) if not (Path(run_dir) / f"rank{r}.jsonl").exists()]


def write_rank_error(run_dir: Path, rank: int, step: int, exc: BaseException) -> None:
    """rank<r>.error.json, as a rank of labkit's own launcher writes it (Run.failure reads the earliest)."""
    import time
    import traceback
    text = "".join(traceback.format_exception(exc))
    error = {"rank": rank, "step": step, "type": type(exc).__name__, "message": str(exc), "traceback": text,
             "time": time.time()}
    (Path(run_dir) / f"rank{rank}.error.json").write_text(json.dumps(error, indent=2))


if __name__ == "__main__":
    sys.exit(main())
