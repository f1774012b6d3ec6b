"""The playground (lesson 15): every trick's knobs on one panel, and what a cell needs to drive it.

    from labkit.tricks.playground import EVERY_TRICK, recorded_steps
    panel = labkit.panel(cfg, fields=EVERY_TRICK)        # one tab per family of tricks
    recorded_steps(panel.jobs[-1].run_dir, world_size=2) # the last step each rank has recorded so far
"""
from ..app.panel import EVERY_TRICK, recorded_steps

__all__ = ["EVERY_TRICK", "recorded_steps"]
