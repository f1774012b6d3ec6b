"""What survives a crash: checkpoints on disk (checkpoint.py), what the loop saves and restores to resume exactly
(resume.py), and sharded state through torch.distributed.checkpoint (sharded.py)."""
