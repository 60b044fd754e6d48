"""The stages of a held model that this executor trains [Note: one model, many holders in
executors/torch/models/built.py]: each with its `StageRunner`, its optimizer once a step made one,
and the last stage's loss scaled for gradient accumulation."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from executors.optable import OpContext
from executors.torch.layout_free import stage_states
from executors.torch.models.built import held_model
from executors.torch.train.fsdp import StageShards
from executors.torch.train.rl_loss import RLLoss
from executors.torch.train.stage import StageRunner

__all__ = ["HeldStage", "held_stage"]


@attrs.define(eq=False)
class HeldStage:
    module: torch.nn.Module
    runner: StageRunner
    optimizer: torch.optim.Optimizer | None = None
    tied: tuple[str, ...] = ()  # names of parameters that are copies of another stage's
    # (rank, size) when its optimizer holds one replica's shard [Note: sharded optimizer states
    # in executors/torch/train/replicas.py]
    shard: tuple[int, int] | None = None
    # its rows of the stage once FSDP cut it [Note: FSDP within a stage in
    # executors/torch/train/fsdp.py]; None: the stage is whole here
    fsdp: StageShards | None = None
    # the whole stage's AdamW states by parameter name, held when FSDP first cut it, for the
    # optimizer of its rows that the next step makes [Note: FSDP checkpoints in
    # executors/torch/fsdp_rows.py]
    saved_states: dict[str, dict] | None = None
    # stage 0: the tokens its forwards ran since the runner last asked [Note: model FLOPs in
    # executors/torch/train/flops.py]
    tokens_run: int = 0
    attended: int = 0  # the squared lengths of the rows those tokens were in, summed
    # a resumed run's AdamW states of this stage, for its optimizer once made [Note:
    # layout-free checkpoints in executors/torch/layout_free.py]
    resumed: dict | None = None
    # (replica group, buckets) the stage's last W of the step started, for its reduce_grads to
    # wait on [Note: all-reduce in the last W in executors/torch/train/replicas.py]
    reducing: tuple[str, Any] | None = None


def held_stage(ctx: OpContext, config: dict) -> HeldStage:
    model = held_model(ctx, config)
    s = int(config["stage"])
    stage = model.stages.get(s)
    if stage is None:
        module = model.parts[s]
        tied = tuple(getattr(module, "tied_copies", lambda: ())())
        runs = _ScaledLoss(module) if s == len(model.parts) - 1 else module
        runner = StageRunner(runs, autocast=model.autocast)
        stage = model.stages[s] = HeldStage(module=module, runner=runner, tied=tied,
                                            resumed=stage_states(model, s))
    return stage


class _ScaledLoss(torch.nn.Module):
    """The last stage with its loss scaled by the microbatch's share of the batch, so that
    the gradients the microbatches add up are the batch's (gradient accumulation)."""

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any) -> torch.Tensor:
        *inputs, scale = args
        if inputs and isinstance(inputs[-1], RLLoss):  # an RL loss reads the stage's output
            *inputs, rl_loss = inputs
            return rl_loss(self.stage(*inputs)) * scale
        return self.stage(*inputs) * scale
