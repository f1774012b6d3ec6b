"""The science behind the lessons, one module per family of tricks:

    envcheck.py    pin your versions: per-rank fingerprints and what differs       (lesson 01)
    comm.py        backends and bandwidth: collective benchmarks, the ring model   (lesson 02)
    scaling.py     GPUs x batch per GPU: scaling efficiency, the linear LR rule    (lesson 03)
    commeff.py     communication efficiency: accumulation, compression, buckets    (lesson 04)
    precision.py   mixed precision: what autocast changes, costs, and skips        (lesson 04)
    loading.py     data loading: where a step's time goes                          (lesson 05)
    averaging.py   sync vs async: local SGD, Hogwild                               (lesson 06)
    sharding.py    data sharding: DistributedSampler's traps, Join                 (lesson 07)
    stability.py   loss spikes and NaNs: what each rank saw, nan_policy, clipping  (lesson 09)
    schedules.py   LR schedules: recorded vs the schedule, ranks' agreement, warmup (lesson 10)
    monitor.py     every rank's TensorBoard events in one table, stragglers, nodes (lesson 11)
    hangs.py       hangs reproduced: the wrong collective, order, shape, a stuck rank (lesson 12)
    debugtools.py  flight-recorder dumps, DETAIL fingerprints, py-spy from outside  (lesson 12)
    recovery.py    checkpoints: what is on disk, broken resumes, restarts, how often  (lesson 13)
    chaos.py       killing a rank from outside, mid-step                           (lesson 13)
    swallow.py     `except Exception: continue` around a distributed step          (lesson 13)
    memory.py      ZeRO's model-state formulas, activations (also labkit.memory)   (lesson 14)
    parallel.py    ZeRO and tensor parallelism measured against the formulas       (lesson 14)
    tpclaim.py     adding tensor parallelism to ZeRO-3: memory by part, speed      (lesson 14)
    exercises/     build DDP and ZeRO yourself: references, checkers on real ranks (lessons 16, 17)

    from labkit.tricks import comm
    comm.benchmark(world_size=2)
"""
