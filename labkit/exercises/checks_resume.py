"""Save and load a rank's whole training state so that a stopped run resumes bit for bit: checked on
2 gloo ranks against a run that was never stopped.

    def save_state(path, model, opt, sched, epoch, step): ...   # one rank's file
    def load_state(path, model, opt, sched): ...                # -> (epoch, step)
    report = check_resume(save_state, load_state)
    save_state, load_state = report.use(resume_reference)       # yours if they passed

The checker runs lesson 13's small DDP loop (dropout from torch's stream, noise from numpy's, a
scale from Python's; AdamW; a StepLR; a DistributedSampler, 4 steps an epoch) three times on 2
ranks: straight through (the reference: it never calls your code), stopped at step 6 (mid-epoch 1:
your save_state writes each rank's file, the launch ends), and a new launch that calls your
load_state and goes on. At every step each rank notes a digest of each piece of its state; the
digests at the first resumed step say which piece did not come back, and a scan of the saved file
says whether save_state left it out or load_state did not put it back:

    runs       every rank finished (a raise names the rank and the learner's line; a hang, each
               rank's place: a collective only some ranks make inside a save)
    position   the resumed run starts at the step it stopped at, on the same batch (a load that
               returns (0, 0) repeats the batches from the start)
    state      weights, optimizer state (AdamW's moments), scheduler, torch / numpy / Python RNG
               streams: each rank's equal to the straight run's at the first resumed step (one
               rank only, e.g. rank 1's weights, is named as such)
    records    every step's loss from the stop on, and the final weights, bit for bit
"""
from __future__ import annotations

import functools
import hashlib
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from .checks_a2a import Pair
from .learner import learner_part, run_checked
from .report import Report

WORLD, STEPS, STOP = 2, 12, 6   # 4 steps an epoch: the stop is mid-epoch 1, after an LR halving
PIECES = {  # the state a step reads -> what it is called in a report
    "weights": "the model's weights", "optimizer": "the optimizer's state (AdamW's exp_avg and "
    "exp_avg_sq, and its step count)", "scheduler": "the LR scheduler's state (its step count)",
    "torch_rng": "torch's RNG stream (the dropout masks)",
    "numpy_rng": "numpy's RNG stream (the input noise)",
    "python_rng": "Python's RNG stream (the input scale)"}
SHORT = {"weights": "weights are", "optimizer": "optimizer state is",
         "scheduler": "scheduler state is", "torch_rng": "torch RNG stream is",
         "numpy_rng": "numpy RNG stream is", "python_rng": "Python RNG stream is"}
_straight: dict[int, list[dict[str, Any]]] = {}   # the reference run: none of the learner's code


def save_state(path: str, model: Any, opt: Any, sched: Any, epoch: int, step: int) -> None:
    """The reference save (lesson 13's): everything the next step reads, written atomically."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                     "python": random.getstate()},
             "epoch": epoch, "step": step}
    torch.save(state, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def load_state(path: str, model: Any, opt: Any, sched: Any) -> tuple[int, int]:
    """The reference load: put every piece back; return the data position (epoch, step)."""
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state["epoch"], state["step"]


resume_reference = Pair(save_state, load_state)   # report.use hands back a pair: unpack it


def _digest(value: Any) -> str:
    """A digest of a tensor, an array or a sequence of ints, the same whatever the container or the
    integer width it was saved in (a tensor of uint8 and a list of the same ints agree)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    array = array.astype(np.int64 if array.dtype.kind in "biu" else np.float64)
    return hashlib.sha1(array.tobytes() + str(array.shape).encode()).hexdigest()[:16]


def _pieces(model: Any, opt: Any, sched: Any) -> dict[str, list[str]]:
    """This rank's state now, piece by piece, as digests."""
    opt_state = [v for s in opt.state_dict()["state"].values() for v in s.values()]
    keys = np.random.get_state()
    return {"weights": [_digest(t) for t in model.state_dict().values()],
            "optimizer": [_digest(t) for t in opt_state],
            "scheduler": [str(sched.last_epoch), repr(sched.get_last_lr())],
            "torch_rng": [_digest(torch.get_rng_state())],
            "numpy_rng": [_digest(keys[1]), str(keys[2])],
            "python_rng": [_digest(random.getstate()[1])]}


def _found_in(obj: Any, found: set[str], depth: int = 0) -> set[str]:
    """Digests of every tensor, array and long run of ints in a loaded file, and the step counts of
    any scheduler state dict in it."""
    if depth > 12:
        return found
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        found.add(_digest(obj))
    elif isinstance(obj, dict):
        if "last_epoch" in obj:
            found.add(str(obj["last_epoch"]))
        for value in obj.values():
            _found_in(value, found, depth + 1)
    elif isinstance(obj, (list, tuple)):
        if len(obj) > 100 and all(isinstance(v, int) for v in obj):
            found.add(_digest(list(obj)))
        else:
            for value in obj:
                _found_in(value, found, depth + 1)
    return found


def _saved(path: str, pieces: dict[str, list[str]]) -> dict[str, bool] | None:
    """Which pieces the learner's file holds (None when it cannot be read back here)."""
    try:
        found = _found_in(torch.load(path, weights_only=False), set())
    except Exception:  # noqa: BLE001 - a file of another layout: the report then blames no side
        return None
    kept = {"scheduler": pieces["scheduler"][:1], "numpy_rng": pieces["numpy_rng"][:1]}
    return {name: set(kept.get(name, digests)) <= found for name, digests in pieces.items()}


def _all_done(ctx: Any, folder: str) -> None:
    """Wait, without a collective, until every rank has saved: a rank that left would close its
    connections, and a collective only some ranks' saves make would fail there instead of hanging
    where the learner's code waits (the launcher's watchdog then names that line)."""
    Path(folder, f".saved{ctx.rank}").touch()
    while not all(Path(folder, f".saved{r}").exists() for r in range(ctx.world_size)):
        time.sleep(0.01)


def _train(ctx: Any, save: Callable | None, load: Callable | None, stop_at: int | None,
           folder: str) -> dict[str, Any]:
    """Lesson 13's loop; with `stop_at`, save before that step and return; with `load`, resume."""
    torch.manual_seed(0)
    X, Y = torch.randn(64, 8), torch.randn(64, 1)   # data and weights: the same on every rank
    sampler = DistributedSampler(range(64), num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    torch.manual_seed(1 + ctx.rank)
    np.random.seed(ctx.rank)
    random.seed(ctx.rank)   # each rank's own streams
    path = f"{folder}/state_of_rank_{ctx.rank}.pt"   # a folder of the checker's, not a run's
    epoch, step = 0, 0
    if load is not None:
        with learner_part(ctx, "load_state"):
            position = load(path, model, opt, sched)
            if not (isinstance(position, tuple) and len(position) == 2
                    and all(isinstance(v, int) and 0 <= v <= STEPS for v in position)):
                raise TypeError(f"load_state returned {position!r}: want (epoch, step), two ints")
        epoch, step = position
    records: list[dict[str, Any]] = []
    while step < STEPS and epoch <= STEPS:
        sampler.set_epoch(epoch)
        ids = list(sampler)   # this rank's 32 ids of this epoch
        for at in range(8 * (step - 4 * epoch), len(ids), 8):
            if step == stop_at:
                pieces = _pieces(model, opt, sched)
                with learner_part(ctx, "save_state", step):
                    save(path, model, opt, sched, epoch, step)
                _all_done(ctx, folder)
                return {"saved": _saved(path, pieces) if os.path.exists(path) else None}
            batch = ids[at:at + 8]
            state = _pieces(model, opt, sched)
            noise = torch.from_numpy(np.random.randn(8, 8)).float()
            x = X[batch] * random.uniform(0.9, 1.1) + 0.05 * noise
            loss = (model(x) - Y[batch]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            records.append({"step": step, "epoch": epoch, "batch": batch, "loss": loss.item(),
                            "state": state})
            ctx.heartbeat()
            step += 1
        epoch += 1
    return {"records": records, "weights": _pieces(model, opt, sched)["weights"]}


def check_resume(save: Callable, load: Callable, *, timeout: float = 20.0,
                 runs_root: Any = None) -> Report:
    """Stop lesson 13's loop at step 6 with `save`, resume it in a new launch with `load`, and
    report on it against a run never stopped:  check_resume(save_state, load_state).ok."""
    names = f"{getattr(save, '__name__', 'save')} and {getattr(load, '__name__', 'load')}"
    report = Report(f"{names}: stop at step {STOP}, resume, {WORLD} gloo ranks",
                    implementation=Pair(save, load))
    hint = ("A save or a load that only some ranks make must not hold a collective (a barrier, a "
            "broadcast): the other ranks never call it.")
    run = functools.partial(run_checked, report, world_size=WORLD, timeout=timeout,
                            runs_root=runs_root, hang_hint=hint)
    if STEPS not in _straight:
        with tempfile.TemporaryDirectory(prefix="labkit-resume-") as folder:
            straight = run(functools.partial(_train, save=None, load=None, stop_at=None,
                                             folder=folder), name="check-resume-straight")
        if straight is None:
            return report
        _straight[STEPS] = straight
    straight = _straight[STEPS]
    with tempfile.TemporaryDirectory(prefix="labkit-resume-") as folder:
        stopped = run(functools.partial(_train, save=save, load=None, stop_at=STOP, folder=folder),
                      name="check-resume-stopped")
        if stopped is None:
            return report
        resumed = run(functools.partial(_train, save=None, load=load, stop_at=None, folder=folder),
                      name="check-resume-resumed")
    if resumed is None:
        return report
    if _position(report, straight, resumed):
        _state(report, straight, stopped, resumed)
    _records(report, straight, resumed, (report.blamed or ["load_state"])[0])
    return report


def _position(report: Report, straight: list[dict], resumed: list[dict]) -> bool:
    for rank, out in enumerate(resumed):
        first = out["records"][0] if out["records"] else None
        want = straight[rank]["records"][STOP]
        if first is None or (first["step"], first["epoch"]) != (STOP, want["epoch"]):
            at = "no step" if first is None else f"epoch {first['epoch']}, step {first['step']}"
            again = " and its batches repeat from the start" if first and first["step"] == 0 else ""
            report.add("position", "fail", f"rank {rank} resumed at {at}, not at epoch "
                                           f"{want['epoch']}, step {STOP} where it stopped{again}: "
                                           "the data position was not restored (save the epoch and "
                                           "the step; return them from load_state)",
                       part="load_state")
            return False
        if first["batch"] != want["batch"]:
            report.add("position", "fail", f"rank {rank}'s first resumed batch (step {STOP}) is "
                                           f"samples {first['batch'][:4]}..., not "
                                           f"{want['batch'][:4]}...: the data position was not "
                                           "restored", part="load_state")
            return False
    report.add("position", "pass", f"both ranks resumed at step {STOP}, on the batch they stopped "
                                   "at")
    return True


def _state(report: Report, straight: list[dict], stopped: list[dict],
           resumed: list[dict]) -> None:
    wrong = {name: [rank for rank in range(WORLD)
                    if resumed[rank]["records"][0]["state"][name]
                    != straight[rank]["records"][STOP]["state"][name]] for name in PIECES}
    for name, ranks in wrong.items():
        if not ranks:
            continue
        saved = [out["saved"][name] for out in stopped if out["saved"] is not None]
        in_file = all(saved) if saved else None
        if len(ranks) < WORLD:
            other = next(r for r in range(WORLD) if r not in ranks)
            noun, verb = SHORT[name].rsplit(" ", 1)
            said = (f"rank {ranks[0]}'s {noun} at step {STOP} {verb} not what it saved (rank "
                    f"{other}'s {verb}): every rank must load its own file"
                    + (" (DDP copies rank 0's weights only when it is built)" if name == "weights"
                       else ""))
        else:
            said = f"{PIECES[name]} was not restored at step {STOP} on either rank"
        if in_file is False:
            said += "; your save_state left it out of the file"
        elif in_file:
            said += "; the file holds it: your load_state did not put it back"
        if name == "optimizer":
            said += (f" (the loss at step {STOP} still matches: it is computed with the saved "
                     f"weights, before the optimizer steps; it parts at step {STOP + 1})")
        report.add(name, "fail", said, part="save_state" if in_file is False else "load_state")
    if not any(wrong.values()):
        report.add("state", "pass", "at the first resumed step every piece of each rank's state "
                                    "equals the straight run's: weights, AdamW's moments, the "
                                    "scheduler, torch, numpy and Python RNG streams")


def _records(report: Report, straight: list[dict], resumed: list[dict], part: str) -> None:
    parted = {}
    for rank in range(WORLD):
        want = {r["step"]: r["loss"] for r in straight[rank]["records"] if r["step"] >= STOP}
        got = {r["step"]: r["loss"] for r in resumed[rank]["records"]}
        parted[rank] = ([s for s in sorted(want) if got.get(s) != want[s]], want, got)
    for rank in sorted(parted, key=lambda r: (parted[r][0] or [STEPS])[0]):  # the first to part
        differ, want, got = parted[rank]
        if differ or sorted(got) != sorted(want):
            first = f"step {differ[0]}" if differ else "the steps it ran"
            report.add("records", "fail", f"rank {rank}'s resumed losses part from the straight "
                                          f"run's at {first} ({len(differ)} of {len(want)} steps "
                                          "differ)", part=part)
            return
        if resumed[rank]["weights"] != straight[rank]["weights"]:
            report.add("records", "fail", f"rank {rank}'s final weights are not the straight run's",
                       part=part)
            return
    report.add("records", "pass", f"every loss from step {STOP} to {STEPS - 1} and the final "
                                  "weights equal the straight run's, bit for bit")
