"""A tiny HF Trainer job on CPU, written as a user would (tests/test_watch_frameworks.py runs it):

    torchrun --nproc-per-node 2 tests/jobs/trainer_job.py                    # under `labkit watch`: no labkit here
    torchrun --nproc-per-node 2 tests/jobs/trainer_job.py --run-dir runs/x   # by hand: LabkitTrainerCallback

Two micro-batches per optimizer step (gradient accumulation). Each rank prints "rank R step S loss L" per
micro-batch (L's every digit): the loss its model returned, before the Trainer divides it for accumulation.
"""
import argparse
import os
import sys
import tempfile

import torch
from transformers import Trainer, TrainingArguments

ACCUMULATE = 2


class Tiny(torch.nn.Module):
    """A model the Trainer accepts: forward(inputs, labels) returns {"loss": ...} (no **kwargs)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x, labels):
        loss = torch.nn.functional.mse_loss(self.layer(x), labels)
        if self.training:
            # one write per line: the ranks share the output file, and print writes the newline apart
            step = self.calls // ACCUMULATE
            sys.stdout.write(f"rank {os.environ['RANK']} step {step} loss {float(loss.detach())!r}\n")
            self.calls += 1
        return {"loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    callbacks = []
    if args.run_dir:
        from labkit.training.callbacks import LabkitTrainerCallback
        callbacks.append(LabkitTrainerCallback(run_dir=args.run_dir))
    torch.manual_seed(0)  # the same data in every rank; the Trainer's sampler gives each rank its own share
    data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(64)]
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=args.steps,
                                     gradient_accumulation_steps=ACCUMULATE, learning_rate=0.1, report_to="none",
                                     save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
                                     use_cpu=True, ddp_backend="gloo", disable_tqdm=True)
        Trainer(model=Tiny(), args=training, train_dataset=data, callbacks=callbacks).train()


if __name__ == "__main__":
    main()
