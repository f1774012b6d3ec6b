"""How the model is spread over the ranks, one module per parallelism (RunConfig.strategy picks; strategies.py
builds): DDP and ZeRO-1 (strategies.py), ZeRO-2/3 with FSDP2 (fullshard.py), tensor parallelism with DTensor
(tensor_parallel.py), and what they are measured by: bytes held (held.py), collectives counted at the dispatcher
(dispatchcount.py), the gradient norm over shards (gradnorm.py); context parallelism's attention over a sequence
split across ranks (context.py)."""
