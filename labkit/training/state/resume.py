"""What labkit's loop puts in a checkpoint, and how a run picks up from one exactly where it left off.

    recovery = Recovery(ctx, config, model, optimizer, scaler=scaler, plateau=plateau)
    task = recovery.resume(task)            # from the newest checkpoint in the run's directory, if there is one
    for step in range(recovery.start_step, config.steps):
        ...                                 # the step, its record
        recovery.after_step(step)           # a checkpoint every config.checkpoint_every steps

A resumed run's records from the checkpoint on are bit for bit those of a run that was never stopped (CPU, gloo,
world 2: tests/test_resume.py), because a checkpoint holds everything the next step reads:
    model and optimizer      state.pt (format "full", rank 0) or sharded/ (format "dcp", every rank): STATE_FORMATS
    per rank, rank<r>.pt:    the step; the RNG streams (torch CPU and CUDA, NumPy, Python): dropout masks and anything
                             else drawn at random differ by rank; the data position (the step of the data stream the
                             next batch comes from); the GradScaler's scale; the plateau scheduler's state (per rank:
                             RunConfig.plateau_per_rank lets them differ)
What needs no saving: the LR (a pure function of the step, training/lr.py), the batches (a pure function of the seed
and the data position, tasks.py), DDP's buckets (the sums they carry do not depend on the bucketing at world 2).
Not restored: PowerSGD's error feedback (RunConfig.comm_hook="powersgd" resumes close to, not exactly on, the run).

A checkpoint that lacks the RNG streams or the data position (one written by a script that forgot them: the lesson
makes such copies with labkit.tricks.recovery.forgetting) still loads, and the rank's log says what was missing:
without RNG state the streams continue from the seed, as in a fresh start; without a data position the data stream
starts again from its first batch.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...config import RunConfig
from ...context import RankContext
from ...records import current_attempt
from .checkpoint import (CheckpointError, Saver, checkpoints_dir, find, load_file, read_manifest, shard_file,
                         write_file)

FULL_FILE = "state.pt"
SHARDED = ("zero2", "fsdp", "tp", "fsdp+tp")  # strategies whose ranks hold different parts of the model state


def state_format(config: RunConfig) -> str:
    """"full" or "dcp": RunConfig.checkpoint_format, with "auto" chosen by how the strategy holds the state."""
    if config.checkpoint_format != "auto":
        return config.checkpoint_format
    return "dcp" if config.strategy in SHARDED else "full"


class Recovery:
    """One rank's checkpoints: resume from the newest one, save every config.checkpoint_every steps."""

    def __init__(self, ctx: RankContext, config: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 scaler: Any = None, plateau: Any = None):
        self.ctx, self.config, self.model, self.optimizer = ctx, config, model, optimizer
        self.scaler, self.plateau = scaler, plateau
        self.root = checkpoints_dir(ctx.run_dir)
        self.format = state_format(config)
        self.start_step, self.data_offset = 0, 0
        barrier = dist.barrier if ctx.world_size > 1 and dist.is_initialized() else (lambda: None)
        self.saver = Saver(self.root, rank=ctx.rank, barrier=barrier, keep=config.checkpoint_keep)

    def resume(self, task: Any) -> Any:
        """Load the newest complete checkpoint of this run, if any; return the task positioned at its data."""
        found = find(self.root, say=print if self.ctx.rank == 0 else (lambda _: None))
        if found is None:
            return task
        manifest = read_manifest(found)
        self._check(found, manifest)
        STATE_FORMATS[manifest["state_format"]].load(found, self.model, self.optimizer)
        own = load_file(shard_file(found, self.ctx.rank))
        if self.scaler is not None and own.get("scaler"):
            self.scaler.load_state_dict(own["scaler"])
        if self.plateau is not None and own.get("plateau"):
            self.plateau.scheduler.load_state_dict(own["plateau"]["scheduler"])
            self.plateau.scheduler.optimizer.param_groups[0]["lr"] = own["plateau"]["lr"]
        missing = [name for name in ("rng", "data") if name not in own]
        if "rng" in own:
            set_rng_state(own["rng"])
        self.start_step = manifest["step"] + 1
        data_step = own["data"]["step"] if "data" in own else 0
        self.data_offset = self.start_step - data_step
        print(f"labkit: resumed from {found} at step {self.start_step}"
              + (f"; the checkpoint has no {' and no '.join(MISSING[m] for m in missing)}" if missing else ""))
        return Positioned(task, self.data_offset) if self.data_offset else task

    def after_step(self, step: int) -> bool:
        """Save a checkpoint if one is due after `step`; return whether one was saved."""
        every = self.config.checkpoint_every
        if not every or (step + 1) % every:
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Save the state after `step` (every rank calls this, with the same step)."""
        dying = any(f.kind == "kill_in_save" and f.rank == self.ctx.rank and f.step == step for f in self.config.faults)
        own = {"step": step, "rng": rng_state(), "data": {"step": step + 1 - self.data_offset},
               "scaler": self.scaler.state_dict() if self.scaler is not None else {},
               "plateau": {"scheduler": self.plateau.scheduler.state_dict(), "lr": self.plateau.lr}
               if self.plateau is not None else {}}

        def write(partial: Any) -> None:
            STATE_FORMATS[self.format].save(partial, self.model, self.optimizer, self.ctx.rank, die_half_way=dying)
            write_file(shard_file(partial, self.ctx.rank), own, die_half_way=dying)
        meta = {"world_size": self.ctx.world_size, "state_format": self.format, "strategy": self.config.strategy,
                "config": self.config.to_dict(), "log": {"attempt": current_attempt()}}
        self.saver.save(step, write, meta)

    def _check(self, found: Any, manifest: dict[str, Any]) -> None:
        if manifest.get("world_size") != self.ctx.world_size:
            raise CheckpointError(
                f"{found} was written by {manifest.get('world_size')} ranks; this run has {self.ctx.world_size}. "
                "Each rank's RNG streams and data position are its own: resume with world_size="
                f"{manifest.get('world_size')} (resharding the model state to another world size is what "
                "torch.distributed.checkpoint can do, but the per-rank streams would not continue)")
        saved = manifest.get("config") or {}
        changed = [f"{k} {saved[k]!r} -> {v!r}" for k, v in self.config.to_dict().items()
                   if k in saved and k not in NOT_COMPARED and saved[k] != v]
        if changed and self.ctx.rank == 0:
            print(f"labkit: this run's config differs from the one that wrote {found.name}: {'; '.join(changed)}. "
                  "It continues from the checkpoint, but it is not the same run")
        if manifest.get("state_format") not in STATE_FORMATS:
            raise CheckpointError(f"{found}: unknown state_format {manifest.get('state_format')!r}; known: "
                                  f"{', '.join(STATE_FORMATS)}")


NOT_COMPARED = {"steps", "name", "faults", "checkpoint_every", "checkpoint_keep", "checkpoint_format", "tensorboard",
                "save_final"}  # settings a resumed run may change without training differently
MISSING = {"rng": "RNG state (the random streams restart from the seed)",
           "data": "data position (the data stream restarts from its first batch)"}


class Positioned:
    """A task whose data stream runs `offset` steps behind the training step (a resume without a data position)."""

    def __init__(self, task: Any, offset: int):
        self.task, self.offset = task, offset

    def batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.task.batch(step - self.offset, micro, rank)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)


# --- model and optimizer state: one class per way of holding it --------------------------------------------------

class FullState:
    """Every rank holds all of the model and optimizer state (DDP; ZeRO-1 after consolidating): rank 0 writes it
    to one file, every rank reads it (the run directory must be on a filesystem all ranks see, as for DCP)."""

    @staticmethod
    def save(directory: Any, model: torch.nn.Module, optimizer: Any, rank: int, *, die_half_way: bool = False) -> None:
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: a collective, on every rank
            optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            write_file(directory / FULL_FILE, {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       die_half_way=die_half_way)

    @staticmethod
    def load(directory: Any, model: torch.nn.Module, optimizer: Any) -> None:
        state = load_file(directory / FULL_FILE)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


class DcpState:
    """torch.distributed.checkpoint: every rank writes the part it holds, reads back the part it needs (sharded.py)."""

    @staticmethod
    def save(directory: Any, model: torch.nn.Module, optimizer: Any, rank: int, *, die_half_way: bool = False) -> None:
        from .sharded import save_sharded
        save_sharded(directory, model, optimizer)

    @staticmethod
    def load(directory: Any, model: torch.nn.Module, optimizer: Any) -> None:
        from .sharded import load_sharded
        load_sharded(directory, model, optimizer)


STATE_FORMATS: dict[str, Any] = {"full": FullState, "dcp": DcpState}
"""state_format -> a class with save(directory, model, optimizer, rank) and load(directory, model, optimizer)."""


# --- RNG streams ------------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """This process's generator states as tensors and numbers (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what rng_state() returned: the next draws are the ones the saved process would have made."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
