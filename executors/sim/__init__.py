"""The timed simulator executor: its ops (ops.py) and its rollout engine (engine.py).

`register` is the executor kind's entry point (`executors.sim:register` in pyproject.toml).
"""

from executors.sim.ops import register

__all__ = ["register"]
