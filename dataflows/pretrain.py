"""Pipeline-parallel language-model pretraining: token batches -> F/B/W under a schedule -> AdamW."""

from __future__ import annotations

from dataflows.ops import Backprop, OptimizerStep
from dataflows.text import token_batches
from flowkit.dsl import Flow, Model, collect

__all__ = ["pretrain_flow"]


def pretrain_flow(*, corpus: str, stages: int = 4, microbatches: int = 8, schedule: str = "1f1b",
                  batch_size: int = 8, seq_len: int = 128, gpt: dict | None = None) -> Flow:
    """One training step of the built-in GPT split into `stages` pipeline stages."""
    model = Model(name="gpt", build="executors.torch.models.gpt:GPT", stages=stages,
                  tags=("train",), config=gpt or {"vocab_size": 256, "n_layer": 4, "n_embd": 128})
    with Flow("pretrain", description=pretrain_flow.__doc__) as flow:
        batches = token_batches(path=corpus, batch_size=batch_size, seq_len=seq_len,
                                batches=microbatches)
        stats = Backprop(model)(batches, loss="lm", schedule=schedule, microbatches=microbatches)
        OptimizerStep(model)(collect(stats))
    return flow
