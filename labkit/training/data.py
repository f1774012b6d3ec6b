"""Which samples each step sees, and the digits input pipeline that delivers them through a torch DataLoader.

    x_train, y_train, x_test, y_test = digits_data()        # sklearn's 8x8 digits, split 1437 / 360
    index = digits_indices(seed=0, n=1437, global_batch=32, step=5, rows=slice(0, 16))   # rank 0's rows of step 5

    cfg = RunConfig(task="digits", world_size=1, data_workers=2, sample_cost_ms=1.0)
    run = labkit.launch(cfg)               # each rank's Digits.batch now pulls from a DataLoader with 2 workers

    stream = DigitsStream(cfg, world_size=1, rank=0)
    x, y = stream.batch(step=0, micro=0)   # bitwise the rows Digits.batch(0, 0, 0) slices from memory
    stream.close()                         # workers end (they also end after the run's last batch)

The order of the samples is a function of (seed, step) only (`step_generator`), so every way of splitting a global
batch over ranks sees the same samples. The pipeline has three pieces, as any real input pipeline:
- `DigitsSamples`, the Dataset: `__getitem__` does `sample_cost_ms` of real CPU work per sample, a stand-in for
  decoding and augmentation (upsample, random affine warp, noise, downsample, then blur passes until the sample
  has used that much CPU time). CPU time, not sleep: the work competes for cores like real decoding, so it slows
  down when processes outnumber cores. The warp is drawn from (seed, position in the stream): reproducible.
  The model is handed the original image (`augment=False`), so every setting of the pipeline trains on the
  same data and only the timing changes; `augment=True` returns the warped image instead.
- `StepBatchSampler`: the keys (image index, stream position) of one rank's micro-batches, step by step, in the
  order the training loop asks for them: the rows Digits.batch takes for (seed, step, micro, rank).
- `DigitsStream`: the DataLoader (num_workers, pin_memory, persistent_workers, prefetch_factor from the config),
  iterated one loader epoch (len(images) // global_batch steps) at a time, as `for x, y in loader` would be.
  With data_workers=0 the work happens in the rank itself: the slow baseline.
"""
from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from ..config import RunConfig

UPSAMPLE = 32   # pixels per side of the working image (the stored digits are 8x8)
# A 3x3 binomial blur: the per-pixel arithmetic that fills each sample's CPU budget.
BLUR = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]).view(1, 1, 3, 3) / 16


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random stream of one step of one data set: a function of (seed, step) only, whoever asks."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def digits_indices(seed: int, n: int, global_batch: int, step: int, rows: slice) -> torch.Tensor:
    """Training-image indices of the rows `rows` of step `step`'s global batch:
    digits_indices(seed=0, n=1437, global_batch=32, step=5, rows=slice(0, 16)).

    The stream of samples runs through epochs, each its own shuffle of the n images, fixed by (seed, epoch)."""
    positions = torch.arange(step * global_batch, (step + 1) * global_batch)[rows]
    epochs = positions // n
    index = torch.empty_like(positions)
    for epoch in epochs.unique().tolist():
        mask = epochs == epoch
        index[mask] = epoch_order(seed, n, epoch)[positions[mask] % n]
    return index


@lru_cache(maxsize=8)
def epoch_order(seed: int, n: int, epoch: int) -> torch.Tensor:
    """The shuffle of n training images used in `epoch` (cached: every step of an epoch reads it)."""
    return torch.randperm(n, generator=step_generator(seed, 10**6 + epoch))


@lru_cache(maxsize=1)
def digits_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): sklearn's digits scaled to [0, 1], split 1437/360 by a fixed shuffle."""
    pixels, labels = digits_table()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1437], order[1437:]
    return x[train], y[train], x[test], y[test]


def digits_table() -> tuple[Any, Any]:
    """(pixels [1797, 64], labels [1797]) as numpy arrays: the CSV bundled with scikit-learn, read directly. Its
    load_digits reads the same file, but importing sklearn costs about 2 s of CPU in every fresh rank process (a
    torchrun worker, each restart of one); finding the file does not import it."""
    import gzip
    import importlib.util

    import numpy as np
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.exists():   # another layout: ask sklearn itself
        from sklearn.datasets import load_digits
        data = load_digits()
        return data.data, data.target
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def sample_work(image: torch.Tensor, seed: int, position: int, cost_ms: float) -> torch.Tensor:
    """Augment one 8x8 image with about `cost_ms` of this thread's CPU time; the result depends only on
    (image, seed, position):  warped = sample_work(x_train[7], seed=0, position=123, cost_ms=1.0)."""
    started = time.thread_time()
    g = step_generator(seed, 2**40 + position)
    big = F.interpolate(image.view(1, 1, 8, 8), size=(UPSAMPLE, UPSAMPLE), mode="bilinear", align_corners=False)
    p = torch.rand(5, generator=g)
    angle, scale = (p[0] - 0.5) * 0.5, 0.9 + 0.2 * p[1]       # about +-14 degrees, 0.9-1.1x
    cos, sin = torch.cos(angle) * scale, torch.sin(angle) * scale
    theta = torch.stack([torch.stack([cos, -sin, (p[2] - 0.5) * 0.2]),
                         torch.stack([sin, cos, (p[3] - 0.5) * 0.2])]).unsqueeze(0)
    warped = F.grid_sample(big, F.affine_grid(theta, list(big.shape), align_corners=False), align_corners=False)
    warped = warped + 0.05 * torch.randn(warped.shape, generator=g)
    out = F.adaptive_avg_pool2d(warped, 8).clamp(0, 1).flatten()
    # Fill the rest of the budget with real arithmetic (not sleep, which would leave the core to others).
    budget, work = cost_ms / 1000.0, warped
    while time.thread_time() - started < budget:
        work = F.conv2d(work, BLUR, padding=1)
    return out


class DigitsSamples(Dataset):
    """Digits training images by key (index, position): `sample_work` on each, or plain indexing at cost 0.

        ds = DigitsSamples(x_train, y_train, seed=0, cost_ms=1.0)
        x, y, position = ds[(index, position)]
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, seed: int, cost_ms: float,
                 augment: bool = False):
        self.images, self.labels, self.seed, self.cost_ms, self.augment = images, labels, seed, cost_ms, augment

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        index, position = key
        image = self.images[index]
        if self.cost_ms > 0 or self.augment:
            warped = sample_work(image, self.seed, position, self.cost_ms)
            image = warped if self.augment else image
        return image, self.labels[index], position


def collate(samples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(images [B, 64], labels [B], stream positions [B]): the positions let the stream check the order."""
    images, labels, positions = zip(*samples)
    return torch.stack(images), torch.stack(labels), torch.tensor(positions)


class StepBatchSampler(Sampler):
    """One rank's micro-batches as lists of (image index, stream position), for steps [start, stop):

        sampler = StepBatchSampler(seed=0, n=1437, global_batch=32, world_size=2, grad_accum=1, rank=1)
        sampler.set_steps(0, 44)       # like DistributedSampler.set_epoch: call before each iter(loader)
        list(sampler)[0]               # the keys of Digits.batch(step=0, micro=0, rank=1)
    """

    def __init__(self, *, seed: int, n: int, global_batch: int, world_size: int, grad_accum: int, rank: int):
        self.seed, self.n, self.global_batch, self.rank = seed, n, global_batch, rank
        self.world_size, self.grad_accum = world_size, grad_accum
        self.batch_size = global_batch // (world_size * grad_accum)
        self.start, self.stop = (0, 0), 0

    def set_steps(self, start: int, stop: int, micro: int = 0) -> None:
        """Yield from (start, micro) up to, not including, step `stop`."""
        self.start, self.stop = (start, micro), stop

    def rows(self, micro: int) -> slice:
        first = (micro * self.world_size + self.rank) * self.batch_size
        return slice(first, first + self.batch_size)

    def keys(self, step: int, micro: int) -> list[tuple[int, int]]:
        rows = self.rows(micro)
        index = digits_indices(self.seed, self.n, self.global_batch, step, rows)
        return [(i, step * self.global_batch + rows.start + k) for k, i in enumerate(index.tolist())]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        (step, micro) = self.start
        while step < self.stop:
            yield self.keys(step, micro)
            step, micro = (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)

    def __len__(self) -> int:
        return max(0, (self.stop - self.start[0]) * self.grad_accum - self.start[1])


def _one_thread(worker_id: int) -> None:
    torch.set_num_threads(1)  # a worker is one more process on the cores: one thread each, like the ranks


class DigitsStream:
    """One rank's batches from a DataLoader, delivered in the loop's order (step, micro), an epoch at a time.

        stream = DigitsStream(cfg, world_size=2, rank=0)
        x, y = stream.batch(step, micro)

    Asked for anything but the next batch, it restarts its iterator there (correct, but the prefetch is lost).
    After the last batch of the run (step config.steps - 1) it stops its workers.
    """

    def __init__(self, config: RunConfig, world_size: int, rank: int, images: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None):
        if images is None or labels is None:
            images, labels = digits_data()[:2]
        self.config, self.rank = config, rank
        self.sampler = StepBatchSampler(seed=config.seed, n=len(images), global_batch=config.global_batch,
                                        world_size=world_size, grad_accum=config.grad_accum, rank=rank)
        self.dataset = DigitsSamples(images, labels, seed=config.seed, cost_ms=config.sample_cost_ms)
        self.steps_per_epoch = max(1, len(images) // config.global_batch)
        self.loader: DataLoader | None = None
        self._iterator: Iterator | None = None
        self._next: tuple[int, int] | None = None   # the (step, micro) the iterator yields next
        self.stop = 0                                # the step where the current loader epoch ends
        self.epochs_started = 0                      # iter(loader) calls: worker (re)starts unless persistent

    def make_loader(self) -> DataLoader:
        workers = self.config.data_workers
        return DataLoader(self.dataset, batch_sampler=self.sampler, collate_fn=collate, num_workers=workers,
                          pin_memory=self.config.pin_memory, worker_init_fn=_one_thread if workers else None,
                          persistent_workers=self.config.persistent_workers and workers > 0,
                          prefetch_factor=self.config.prefetch_factor if workers else None)

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self._next != (step, micro):
            self._start_epoch(step, micro)
        try:
            images, labels, positions = next(self._iterator)
        except StopIteration:  # only if the sampler and the stream disagree about the epoch's length
            raise RuntimeError(f"DataLoader ran out before step {step}, micro {micro}") from None
        expected = step * self.config.global_batch + self.sampler.rows(micro).start
        if int(positions[0]) != expected or len(positions) != self.sampler.batch_size:
            raise RuntimeError(f"DataLoader delivered positions {positions[0].item()}.. for step {step}, micro "
                               f"{micro}; expected {expected}..")
        self._advance(step, micro)
        return images, labels

    def _start_epoch(self, step: int, micro: int) -> None:
        epoch_end = (step // self.steps_per_epoch + 1) * self.steps_per_epoch
        stop = min(epoch_end, max(self.config.steps, step + 1))  # no prefetching past the run's last step
        self.sampler.set_steps(step, stop, micro)
        if self.loader is None:
            self.loader = self.make_loader()
        self._iterator = None  # a non-persistent loader's old workers stop here, before new ones start
        self._iterator = iter(self.loader)
        self._next, self.stop = (step, micro), stop
        self.epochs_started += 1

    def _advance(self, step: int, micro: int) -> None:
        step, micro = (step, micro + 1) if micro + 1 < self.config.grad_accum else (step + 1, 0)
        if step >= self.config.steps:
            self.close()  # the run's last batch: nothing more will be asked for, so the workers can go
        elif step >= self.stop:
            self._next = None  # end of the epoch: the next call stops the old workers and starts the next epoch
        else:
            self._next = (step, micro)

    def close(self) -> None:
        """Stop the workers (joined, not killed); a later batch() starts new ones."""
        self._iterator = self._next = None
        self.loader = None  # a persistent loader keeps its iterator (and workers) until it goes
