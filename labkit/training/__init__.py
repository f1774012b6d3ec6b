"""What runs inside a rank: the instrumented training loop and everything it uses.

    loop.py        train(ctx, config): one record per step and rank
    tasks.py       the built-in tasks: a model, the batches of each step, a loss
    data.py        which samples each step sees; the digits DataLoader pipeline
    schedule.py    learning-rate schedules as pure functions of the step (labkit's own and transformers')
    plateau.py     the "plateau" schedule: ReduceLROnPlateau on a held-out loss all ranks agree on
    stability.py   non-finite losses and gradients (RunConfig.nan_policy), clipping with its coefficient
    commhooks.py   how DDP sends gradients, and the collectives a rank really issued, counted
    amp.py         mixed precision: autocast, and whether GradScaler let each optimizer step happen
    faults.py      failures injected on purpose
    seeding.py     seeds, RNG fingerprints, determinism switches
    strategies.py  RunConfig.strategy: DDP, ZeRO-1, FSDP2 (fullshard.py), tensor parallel (tensor_parallel.py),
                   with the bytes each rank holds (held.py), the collectives (dispatchcount.py), the grad norm
                   over shards (gradnorm.py)
    checkpoint.py  checkpoints on disk: atomic saves, finding the newest complete one, weights_only loading
    resume.py      what the loop saves and restores (model, optimizer, RNG streams, data position), exactly
    sharded.py     model and optimizer state through torch.distributed.checkpoint, read without pickle

Nothing here knows how it was started (labkit's launcher or torchrun) or how it will be shown.
"""
