"""The science behind the lessons, one module per family of tricks:

    envcheck.py    pin your versions: per-rank fingerprints and what differs       (lesson 01)
    comm.py        backends and bandwidth: collective benchmarks, the ring model   (lesson 02)
    scaling.py     GPUs x batch per GPU: scaling efficiency, the linear LR rule    (lesson 03)
    commeff.py     communication efficiency: accumulation, compression, buckets    (lesson 04)
    precision.py   mixed precision: what autocast changes, costs, and skips        (lesson 04)
    loading.py     data loading: where a step's time goes                          (lesson 05)
    averaging.py   sync vs async: local SGD, Hogwild                               (lesson 06)
    sharding.py    data sharding: DistributedSampler's traps, Join                 (lesson 07)
    memory.py      ZeRO's model-state formulas, activations (also labkit.memory)   (lesson 14)
    parallel.py    ZeRO and tensor parallelism measured against the formulas       (lesson 14)
    tpclaim.py     adding tensor parallelism to ZeRO-3: memory by part, speed      (lesson 14)
    exercises/     build DDP and ZeRO yourself: references, checkers on real ranks (lessons 16, 17)

    from labkit.tricks import comm
    comm.benchmark(world_size=2)
"""
