"""The torch executor: pipeline stages of torch models run as F, B, W and BW ops.

`StageRunner` is the per-stage engine, usable on its own; the built-in GPT lives in
`executors.torch.models.gpt`.
"""

from executors.torch.stage import StageError, StageRunner

__all__ = ["StageError", "StageRunner"]
