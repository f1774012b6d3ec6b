"""A tiny Lightning DDP job on CPU, written as a user would (tests/test_watch_frameworks.py runs it):

    python tests/jobs/lightning_job.py                    # under `labkit watch`: no labkit in this file
    python tests/jobs/lightning_job.py --run-dir runs/x   # by hand: LabkitLightningCallback(run_dir=...)

Lightning starts rank 1 itself (it runs this file again with LOCAL_RANK=1). Each rank prints
"rank R step S loss L" per optimizer step (L's every digit) and "env R RANK=..." once.
"""
import argparse
import os
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        # one write per line: the two processes share the output file, and print writes the newline apart
        sys.stdout.write(f"rank {self.global_rank} step {self.global_step} loss {float(loss.detach())!r}\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    callbacks = []
    if args.run_dir:
        from labkit.training.callbacks import LabkitLightningCallback
        callbacks.append(LabkitLightningCallback(run_dir=args.run_dir))
    torch.manual_seed(0)  # the same data in every process; Lightning's sampler gives each rank its own half
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, callbacks=callbacks,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    sys.stdout.write(f"env {trainer.global_rank} RANK={os.environ.get('RANK')}\n")
    trainer.fit(Tiny(), DataLoader(data, batch_size=2))


if __name__ == "__main__":
    main()
