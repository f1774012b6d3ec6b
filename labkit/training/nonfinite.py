"""Non-finite losses and gradients, and what each rank does about them; gradient clipping, measured.

    guard = NanGuard("stop", model, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
    guard.start_step()                      # before the step's first backward
    ... forward and backward ...
    bad = guard.agree(loss)                 # stop/skip: ranks whose loss or gradients were not finite, the same
                                            # list on every rank (one all-reduce of world_size floats)
    fields = optimizer_step(model, optimizer, scaler, clip_norm=1.0, take=not bad)
    fields                                  # {"grad_norm": 3.2, "clip_coef": 0.31}
    if guard.leaves(loss, step, bad): ...   # raises NonFiniteLoss, or True: this rank leaves its loop

RunConfig.nan_policy says which (the config's docstring has the whole story):
- "raise" and "alone" look at this rank's own loss only: no collective. "raise" fails at once (labkit's launcher,
  like torchrun's agent, then stops the other ranks); "alone" leaves the loop quietly, as the folklore
  `if math.isnan(loss): break` does, and its peers wait in their next collective.
- "stop" and "skip" agree first. Each rank sets its slot of a flag vector to 1 when its loss, or one of its own
  gradients before DDP averaged them, was not finite; one all-reduce gives every rank the same list of culprits.
  Local gradients are seen by post-accumulate hooks (they run before DDP's averaged gradients are written back):
  after the average, one rank's NaN is everyone's. Under fp16 a GradScaler already skips steps whose scaled
  gradients overflowed, and overflow is routine there, so only the loss raises the flag.

Clipping: `optimizer_step` unscales first (GradScaler's scale would otherwise multiply the norm that clipping sees),
measures the global norm, clips, and measures again: `clip_coef` is the norm clipping left divided by the norm
before (exactly 1.0 on steps where it did not act), so the records show what clipping did, not what it was told.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .parallel.gradnorm import clip_with_norm, total_norm

AGREEING = ("stop", "skip")


class NonFiniteLoss(FloatingPointError):
    """The loss (or a gradient) became NaN or infinite (RunConfig.nan_policy "raise" or "stop")."""


class NanGuard:
    """One rank's watch over non-finite values, for one RunConfig.nan_policy (see the module docstring)."""

    def __init__(self, policy: str, model: torch.nn.Module, *, rank: int, world_size: int, device: torch.device,
                 check_gradients: bool = True):
        self.policy, self.rank, self.world_size = policy, rank, world_size
        self.check_gradients = check_gradients and policy in AGREEING
        self.armed = True   # False: the hooks do nothing (the flag's cost, measured with and without)
        self.left = False   # "alone": this rank has left its loop
        self._checks: list[tuple[str, torch.Tensor]] = []
        self._flag = torch.zeros(world_size, device=device)
        self._handles = [p.register_post_accumulate_grad_hook(self._checker(name))
                         for name, p in model.named_parameters() if p.requires_grad and policy in AGREEING]

    @property
    def agrees(self) -> bool:
        """Whether this policy all-reduces a flag each step."""
        return self.policy in AGREEING

    def _checker(self, name: str) -> Any:
        def check(param: torch.Tensor) -> None:
            if self.armed:  # a lazy tensor: no sync with the device here
                self._checks.append((name, torch.isfinite(param.grad).all()))
        return check

    def start_step(self) -> None:
        """Forget the previous step's gradient checks."""
        self._checks.clear()

    def agree(self, loss: float) -> list[int]:
        """The ranks whose loss or own gradients were not finite at this step, the same list on every rank."""
        self._flag.zero_()
        bad = 0.0 if math.isfinite(loss) else 1.0
        if self.check_gradients and self._checks:
            self._flag[self.rank] = (~torch.stack([ok for _, ok in self._checks]).all()).float()
        self._flag[self.rank] += bad
        dist.all_reduce(self._flag)
        return [r for r, v in enumerate(self._flag.tolist()) if v]

    def first_bad_parameter(self) -> str | None:
        """The first parameter whose gradient on this rank was not finite, in the order backward produced them."""
        return next((name for name, ok in self._checks if not ok.item()), None)

    def leaves(self, loss: float, step: int, bad: list[int]) -> bool:
        """After the step's record: raise NonFiniteLoss, or return True when this rank leaves its loop now."""
        if loss is None:
            return False  # a pipeline stage before the last: it never sees the loss
        if self.policy == "raise" and not math.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss} at step {step} on rank {self.rank}; lower the LR, clip gradients "
                                "(clip_norm) or warm up")
        if self.policy == "alone" and not math.isfinite(loss):
            print(f"labkit: loss is {loss} at step {step} on rank {self.rank}: this rank leaves its loop "
                  "(nan_policy='alone'); its peers are not told")
            self.left = True
            return True
        if self.policy == "stop" and bad:
            if self.rank == bad[0]:
                raise NonFiniteLoss(self._stop_message(loss, step, bad))
            print(f"labkit: rank {bad[0]} went non-finite at step {step}; every rank stops here (nan_policy='stop')")
            return True
        return False

    def _stop_message(self, loss: float, step: int, bad: list[int]) -> str:
        param = self.first_bad_parameter() if self.check_gradients else None
        gradient = (f"first non-finite gradient (in backward's order): {param}" if param else
                    "its gradients were finite before the average (or not checked, under fp16): only its loss was not")
        others = f"; also non-finite at this step: ranks {bad[1:]}" if len(bad) > 1 else ""
        return (f"rank {self.rank} went non-finite first, at step {step}: loss {loss}, {gradient}{others}. Every rank "
                f"stopped at step {step} without taking it (nan_policy='stop'); lower the LR, clip gradients "
                "(clip_norm), warm up, or look at this rank's batch")

    def wait_for_peers(self) -> None:
        """What a hand-written loop does once it has left ("alone"): wait for the other ranks at the end of
        training (a barrier before saving). Peers still inside their loop never join it."""
        if self.left and dist.is_initialized():
            dist.barrier()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, clip_norm: float | None,
                   *, take: bool = True) -> dict[str, float]:
    """Unscale, measure the global gradient norm, clip (and measure what clipping left), step unless `take` is
    False (every rank skips together), zero the gradients:  optimizer_step(model, opt, scaler, 1.0).
    Returns grad_norm (before clipping) and clip_coef (norm after clipping / before; 1.0 without clipping)."""
    scaler.unscale_(optimizer)  # clip the true gradients: before unscaling, their norm is loss_scale times too big
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    norm = total_norm(grads)  # over shards too, when the strategy shards gradients (gradnorm.py)
    coef = 1.0
    if clip_norm is not None:
        clip_with_norm(params, clip_norm, norm)
        after = total_norm(grads)
        coef = (after / norm).item() if norm.item() != 0 else 1.0
    if take:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": norm.item(), "clip_coef": coef}
