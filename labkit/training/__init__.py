"""What runs inside a rank: the instrumented training loop and everything it uses.

The loop and what it runs:
    loop.py        train(ctx, config): one record per step and rank
    tasks.py       the built-in tasks: a model, the batches of each step, a loss
    data.py        which samples each step sees; the digits DataLoader pipeline
    optim.py       the optimizer a RunConfig names (the loop's and every strategy's)
    lr.py          learning-rate schedules as pure functions of the step (labkit's own and transformers')
    plateau.py     the "plateau" schedule: ReduceLROnPlateau on a held-out loss all ranks agree on
    nonfinite.py   non-finite losses and gradients (RunConfig.nan_policy), clipping with its coefficient
    commhooks.py   how DDP sends gradients, and the collectives a rank really issued, counted
    amp.py         mixed precision: autocast, and whether GradScaler let each optimizer step happen
    inject.py      failures injected on purpose (RunConfig.faults)
    seeding.py     seeds, RNG fingerprints, determinism switches
    fp8.py         FP8 formats, quantising with one scale per tensor, tile or block (RunConfig.precision="fp8")
    fp8_linear.py  a linear layer's matmuls in simulated FP8, forward and backward (DeepSeek-V3's recipe)
    fp8_layers.py  which layers of the tiny models switch to FP8, in place; fp8_wire.py: FP8 expert dispatch
Inside a rank of YOUR job, under `labkit watch` (no training loop of labkit's):
    agent.py       records each optimizer step, beats, stacks and the Flight Recorder on request; started by
                   site/sitecustomize.py (first on the job's PYTHONPATH) or by a framework's callback
    flight.py      torch's Flight Recorder, read: the one module touching its private API
    callbacks.py   the HF Trainer's and Lightning's callbacks (Lightning's added by an entry point under watch)
How the model is spread over the ranks (parallel/):
    strategies.py  RunConfig.strategy: DDP, ZeRO-1, FSDP2 (fullshard.py), tensor parallel (tensor_parallel.py),
                   with the bytes each rank holds (held.py), the collectives (dispatchcount.py), the grad norm
                   over shards (gradnorm.py)
What survives a crash (state/):
    checkpoint.py  checkpoints on disk: atomic saves, finding the newest complete one, weights_only loading
    resume.py      what the loop saves and restores (model, optimizer, RNG streams, data position), exactly
    sharded.py     model and optimizer state through torch.distributed.checkpoint, read without pickle

Nothing here knows how it was started (labkit's launcher or torchrun) or how it will be shown.
"""
