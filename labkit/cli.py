"""`python -m labkit ...`: the same training loop from a terminal, alone or under torchrun.

    python -m labkit run config.json                          # launches the ranks itself (like a notebook)
    torchrun --nproc-per-node 2 -m labkit run config.json --run-dir runs/job1
                                                              # one rank per torchrun process (many nodes too)
    python -m labkit summary runs/job1                        # headline figures of a finished run

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
    summary = sub.add_parser("summary", help="print a finished run's headline figures")
    summary.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "summary":
        from .records import Run
        print(json.dumps(Run(args.run_dir).summary(), indent=2))
        return 0
    config = RunConfig.load(args.config)
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return run_under_torchrun(config, args.run_dir, args.timeout)
    from .run.launch import launch
    result = launch(config, timeout=args.timeout, runs_root=args.run_dir.parent if args.run_dir else None)
    print(json.dumps(result.summary(), indent=2))
    return 0


def run_under_torchrun(config: RunConfig, run_dir: Path | None, timeout: float) -> int:
    """This process is one rank that torchrun started: join its group, train, record, leave."""
    import torch
    import torch.distributed as dist
    from .records import RankRecorder, write_meta, write_tensorboard
    from .run.rank import RankContext, resolve_backend
    from .training.loop import train
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world != config.world_size:
        config = config.replace(world_size=world)  # torchrun decides the world; keep the records truthful
    run_dir = run_dir or Path("runs") / f"{config.label}-{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    backend = resolve_backend(config.backend, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    if rank == 0:
        config.save(run_dir / "config.json")
        write_meta(run_dir, name=config.label, world_size=world, start_method="torchrun")
    recorder = RankRecorder(run_dir, rank)
    ctx = RankContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, device=device,
                      run_dir=run_dir, config=config, recorder=recorder)
    try:
        train(ctx, config)
    finally:
        recorder.close()
        dist.destroy_process_group()
        if config.tensorboard:
            write_tensorboard(run_dir, ranks=[rank])  # each rank converts its own records, after training
    return 0


if __name__ == "__main__":
    sys.exit(main())
