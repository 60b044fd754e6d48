"""Pipeline-parallel language-model pretraining: token sequences -> microbatches -> F/B/W of the
model's stages under a schedule -> AdamW with global-norm clipping -> step metrics."""

from __future__ import annotations

from typing import Any

from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.models import flow_model
from dataflows.text import token_sequences
from flowkit.dsl import Flow, Model, Operator, collect

__all__ = ["DEFAULT_GPT", "pretrain_flow"]

# small enough to train on two CPU cores in a minute, deep enough for 4 stages
DEFAULT_GPT = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}


def pretrain_flow(*, model: Model | None = None, corpus: str | None = None,
                  stages: int | None = None, microbatches: int = 8, schedule: str = "1f1b",
                  batch_size: int = 32, seq_len: int = 64, gpt: dict | None = None,
                  lr: float = 1e-3, clip_grad_norm: float = 1.0, tags: tuple = ("train",),
                  name: str = "pretrain", model_name: str = "gpt",
                  source: Operator | None = None, source_config: dict[str, Any] | None = None
                  ) -> Flow:
    """One training step of `model` (any Model, dataflows/models.py; else the built-in GPT
    named `model_name`, configured by `gpt`, 4 stages, on `tags` executors), re-cut into
    `stages` pipeline stages when given: `batch_size` sequences a step, cut into
    `microbatches`, gradients accumulated over them. The sequences come from `corpus` (a text
    file), or from a `source` op taking `sequences=batch_size` and `source_config` (supervised
    data such as dataflows.rl.tasks.sort_sequences)."""
    if (corpus is None) == (source is None):
        raise ValueError("pretrain_flow takes a corpus file or a source op, exactly one")
    model = flow_model(model, gpt=gpt, default_gpt=DEFAULT_GPT, name=model_name, stages=stages,
                       default_stages=4, tags=tags)
    with Flow(name, description=pretrain_flow.__doc__) as flow:
        if source is None:
            sequences = token_sequences(path=corpus, sequences=batch_size, seq_len=seq_len)
        else:
            sequences = source(sequences=batch_size, **(source_config or {}))
        stats = Backprop(model)(sequences, loss="lm", schedule=schedule, microbatches=microbatches)
        OptimizerStep(model)(collect(stats), lr=lr, clip_grad_norm=clip_grad_norm)
    return flow
