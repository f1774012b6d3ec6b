"""Model and optimizer state through torch.distributed.checkpoint (DCP): each rank writes the part it holds and
reads back the part it needs, so the same files serve DDP, ZeRO, FSDP and tensor parallelism alike.

    save_sharded(partial_dir, model, optimizer)    # on every rank: writes partial_dir/sharded/
    load_sharded(step_dir, model, optimizer)       # on every rank: fills model and optimizer in place

get_state_dict / set_state_dict (torch.distributed.checkpoint.state_dict) name every entry by its parameter's full
name whatever wraps the model (DDP, FSDP2, DTensor); DCP stores replicated tensors once, and sharded ones as the
shards the ranks hold (it can reshard on load). It runs collectives: call both on every rank.

Why not dcp.load as it comes: in torch 2.13 its reader unpickles the `.metadata` file, and its planner any
non-tensor value, with plain pickle, which runs whatever code a crafted file names. Here the metadata goes through
an unpickler that builds only DCP's own metadata classes, and non-tensor values through torch.load(weights_only=
True): the promise of checkpoint.py (no code runs from a checkpoint file) holds for DCP checkpoints too.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .checkpoint import CheckpointError

SHARDED_DIR = "sharded"
# What DCP's metadata file is built from (torch 2.13): its own dataclasses, sizes, dtypes, paths.
_ALLOWED = {("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}


def save_sharded(directory: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Write this rank's part of the model and optimizer state under directory/sharded/ (every rank calls it)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=Path(directory) / SHARDED_DIR)


def load_sharded(directory: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Fill model and optimizer from directory/sharded/ (every rank calls it), reading no pickled code."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    path = Path(directory) / SHARDED_DIR
    dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _ALLOWED or module in _ALLOWED_MODULES or isinstance(found, torch.dtype):
            return super().find_class(module, name)
        raise CheckpointError(f"refused to load a DCP checkpoint: its metadata names {module}.{name}, which is not "
                              "part of DCP's metadata; loading it could run code from the file")


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata unpickled by an allow-list of DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        plain = torch.load(value, weights_only=True)
        super().load_bytes(read_item, _Saved(plain))


class _Saved(io.BytesIO):
    """A value already read safely, handed to the parent planner as the stream it expects."""

    def __init__(self, value: Any):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        super().__init__(buffer.getvalue())
