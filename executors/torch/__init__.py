"""The torch executor: pipeline stages of torch models run as F, B, W and BW ops.

`StageRunner` is the per-stage engine, usable on its own; the built-in GPT lives in
`executors.torch.models.gpt`.
"""

from executors.torch.errors import StageError
from executors.torch.train.stage import StageRunner


def register(table) -> None:
    """The torch executor kind's ops: pipeline stages and the optimizer step
    (train/pipeline_ops.py), generation (rollout/generate.py), scoring (rollout/infer.py), run
    checkpoints (state.py)."""
    from executors.torch import device, state
    from executors.torch.rollout import generate, infer
    from executors.torch.train import pipeline_ops

    device.configure_tf32()  # fp32 matmuls on CUDA as TF32, unless FLOWKIT_TF32=0
    device.configure_attention()  # [Note: no cuDNN attention] in executors/torch/device.py
    table.on_op_end(device.synchronize_op)  # [Note: device time] in executors/torch/device.py
    pipeline_ops.register(table)
    table.register("save_state", state.save_state)
    table.register("load_state", state.load_state)
    generate.register(table)
    infer.register(table)


__all__ = ["StageError", "StageRunner", "register"]
