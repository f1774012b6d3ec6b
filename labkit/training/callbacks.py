"""Callbacks for the HF Trainer and for Lightning, so labkit's records hold each rank's own loss.

    from labkit.training.callbacks import LabkitTrainerCallback, LabkitLightningCallback
    transformers.Trainer(..., callbacks=[LabkitTrainerCallback(run_dir="runs/x")])
    lightning.pytorch.Trainer(..., callbacks=[LabkitLightningCallback(run_dir="runs/x")])
    labkit.load_run("runs/x").df        # one record per rank and optimizer step, as `labkit watch` writes them

    python -m labkit watch -- python train_lightning.py                 # no callback in the script: added for you
    python -m labkit watch -- torchrun --nproc-per-node 2 train_hf.py   # no callback needed (see below)

Both frameworks log a loss averaged over the ranks, on rank 0 only; these records keep each rank's own. By hand,
the callback starts the agent (training/agent.py) itself as the trainer's global rank, writing into `run_dir`; under
`labkit watch` (run_dir omitted) it joins the agent already running, or starts it into $LABKIT_WATCH_DIR.

Lightning, without a code change: labkit declares a `lightning.pytorch.callbacks_factory` entry point (and the same
for the `pytorch_lightning` package); every Lightning Trainer calls it, and it adds the callback only when
$LABKIT_WATCH_DIR is set. It must start the agent itself: `python train.py` has no $RANK, nor do the processes
Lightning starts for the other ranks (it sets LOCAL_RANK, NODE_RANK, WORLD_SIZE), so sitecustomize starts none.
Per optimizer step it notes raw_loss, the mean over the step's batches of what training_step returned: the hook
that sees it before the step is on_before_backward, which gets it divided by accumulate_grad_batches and, with
16-bit AMP, multiplied by the GradScaler's scale, both undone here. on_train_batch_end would come after the step,
so its note would land in the next step's record. It also measures grad_norm and lr again (the agent's own pre-step
measure), in on_before_optimizer_step: Lightning runs training_step and backward inside optimizer.step(closure),
after the optimizer's pre-step hook, where the agent would read the previous step's gradients.

HF Trainer, without a code change: under torchrun $RANK is set, so the agent records every optimizer step already,
its loss from what the Trainer passes to backward. transformers has no entry point for callbacks, and patching
Trainer.__init__ from an import hook would change the user's class behind their back; the callback adds only
trainer_step and grad_clip, so under watch it is left out. What backward gets (transformers 5), so what `loss`
means: for a model whose forward takes no **kwargs, or a batch without labels, each micro-batch's loss divided by
gradient_accumulation_steps; for one that takes **kwargs (transformers' models), each micro-batch's summed token
loss divided by the label tokens of the whole step (every rank's, every micro-batch's), times the world size. Either
way `loss * backward_calls`, the record's sum over the step, is this rank's own loss for the step (in the second
case exactly when the ranks hold as many label tokens each) and what the Trainer adds to its logged loss before it
averages over ranks; with one micro-batch per step, `loss` itself. With fp16, backward gets it times the
GradScaler's scale too. grad_norm is read after the Trainer's clipping (it clips before optimizer.step), hence
grad_clip (args.max_grad_norm) in the record when it clips.

transformers and lightning are imported only when a class is first used (module __getattr__), never by `import
labkit`.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Any

DIR_ENV = "LABKIT_WATCH_DIR"  # agent.DIR_ENV: every Lightning Trainer calls the factories; unwatched, no import
_LIGHTNING = {"LabkitLightningCallback": "lightning.pytorch", "LabkitPytorchLightningCallback": "pytorch_lightning"}


def __getattr__(name: str) -> type:
    if name == "LabkitTrainerCallback":
        return _trainer_class()
    if name in _LIGHTNING:
        return _lightning_class(_LIGHTNING[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lightning_callbacks() -> list[Any]:
    """The `lightning.pytorch.callbacks_factory` entry point: the callback under `labkit watch`, else none."""
    return [_lightning_class("lightning.pytorch")()] if os.environ.get(DIR_ENV) else []


def pytorch_lightning_callbacks() -> list[Any]:
    """The same for scripts that import `pytorch_lightning` (its Trainer accepts only its own Callback class)."""
    return [_lightning_class("pytorch_lightning")()] if os.environ.get(DIR_ENV) else []


def _start(rank: int, run_dir: Any) -> Any:
    from pathlib import Path
    from . import agent
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)  # by hand nobody made it; under watch it exists
    return agent.start(rank=rank, run_dir=run_dir)


@functools.cache
def _trainer_class() -> type:
    from transformers import TrainerCallback

    class LabkitTrainerCallback(TrainerCallback):
        """Records each rank's optimizer steps (see labkit.training.callbacks): callbacks=[LabkitTrainerCallback()]
        under `labkit watch`, or LabkitTrainerCallback(run_dir="runs/x") by hand."""

        def __init__(self, run_dir: str | os.PathLike | None = None):
            self.run_dir, self.agent = run_dir, None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.agent = _start(args.process_index, self.run_dir)  # process_index: the global rank

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.agent is None:
                return
            # global_step counts the steps done; the Trainer's logs name this step by the count after it
            clip = {"grad_clip": float(args.max_grad_norm)} if args.max_grad_norm and args.max_grad_norm > 0 else {}
            self.agent.note(trainer_step=state.global_step + 1, **clip)

    _place(LabkitTrainerCallback, "LabkitTrainerCallback")
    return LabkitTrainerCallback


@functools.cache
def _lightning_class(package: str) -> type:
    Callback = importlib.import_module(package).Callback
    name = next(n for n, p in _LIGHTNING.items() if p == package)

    class LabkitLightningCallback(Callback):
        """Records each rank's optimizer steps with its raw loss (see labkit.training.callbacks):
        callbacks=[LabkitLightningCallback(run_dir="runs/x")] by hand; under `labkit watch` it is added for you."""

        def __init__(self, run_dir: str | os.PathLike | None = None):
            self.run_dir, self.agent, self.losses = run_dir, None, []

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            # setup runs in every rank once the processes exist, before the DDP wrap's first broadcast: a hang
            # there is watched too. The first labkit callback in the list records; a second (by hand and from
            # the entry point both) stays idle rather than note twice.
            first = next(c for c in trainer.callbacks if type(c).__name__ in _LIGHTNING)
            if stage == "fit" and first is self:
                self.agent = _start(trainer.global_rank, self.run_dir)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self.agent is None:
                return
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
            # automatic optimization divides by accumulate_grad_batches; manual optimization passes the loss as is
            accumulated = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self.losses.append(loss.detach().float() * (accumulated / scale))

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.agent is None:
                return
            # the agent's pre-step measure (grad_norm, lr) again: only now has backward run (see the docstring)
            self.agent.measure_gradients(optimizer)
            losses, self.losses = self.losses, []
            fields = {"trainer_step": trainer.global_step + 1}
            if losses:
                fields["raw_loss"] = sum(float(t) for t in losses) / len(losses)
            self.agent.note(**fields)

    _place(LabkitLightningCallback, name)
    return LabkitLightningCallback


def _place(cls: type, name: str) -> None:
    """Name a built class where pickle and reprs look for it: this module, through __getattr__."""
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = __name__
