"""The torch executor: pipeline stages of torch models run as F, B, W and BW ops.

`StageRunner` is the per-stage engine, usable on its own; the built-in GPT lives in
`executors.torch.models.gpt`.
"""

from executors.torch.stage import StageError, StageRunner


def register(table) -> None:
    """The torch executor kind's ops (executors/torch/ops.py)."""
    from executors.torch.ops import register as register_ops

    register_ops(table)


__all__ = ["StageError", "StageRunner", "register"]
