"""Pipeline-parallel training on real torch executor processes equals a plain loop.

Each schedule trains a small GPT for a few steps through `FlowRunner` (F/B/W on the executors,
gradient accumulation over microbatches, global-norm clipping, AdamW per stage); a plain
single-process loop trains the same model on the same data; every parameter must match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataflows.pretrain import pretrain_flow
from executors.torch.models.gpt import GPT
from tests.harness import (
    per_stage,
    plain_training,
    seeded_gpt,
    tiny_gpt,
    trained_on_executors,
)

CORPUS = str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt")
DEVICES, MICROBATCHES, SEQUENCES, SEQ_LEN, STEPS = 2, 4, 8, 8, 2
GPT_CONFIG = tiny_gpt(vocab_size=256, block_size=16, n_layer=4, n_embd=16)
HPARAMS = {"lr": 1e-2, "clip_grad_norm": 0.5}  # small enough a norm that clipping happens


@pytest.fixture(scope="module")
def torch_cluster(pool):
    with pool.shared(DEVICES, kind="torch", tags=("train",)) as (ctl, _):
        yield ctl


def _train_on_executors(ctl, schedule: str, dtype: str, name: str) -> tuple[list, dict]:
    flow = pretrain_flow(corpus=CORPUS, stages=DEVICES, microbatches=MICROBATCHES,
                         schedule=schedule, batch_size=SEQUENCES, seq_len=SEQ_LEN,
                         gpt={**GPT_CONFIG, "dtype": dtype, "seed": 3}, model_name=name,
                         **HPARAMS)
    losses, runner = trained_on_executors(ctl, flow, name, STEPS)
    params = per_stage(ctl, runner, name, "stage_parameters")
    return losses, params, len(params)


def _train_plain(dtype: torch.dtype) -> tuple[GPT, list[float]]:
    """The reference: one process, the unsplit model, the same batches and accumulation."""
    model = seeded_gpt(GPT_CONFIG, seed=3, dtype=dtype)
    losses = plain_training(model.parameters(), lambda b: model(b[:, :-1], b[:, 1:]),
                            corpus=CORPUS, steps=STEPS, sequences=SEQUENCES, seq_len=SEQ_LEN,
                            microbatches=MICROBATCHES, **HPARAMS)
    return model, losses


def _assert_match(model: GPT, params: dict, stages: int, *, close) -> None:
    reference = model.split(stages)
    checked = 0
    for stage, module in enumerate(reference):
        for name, expected in module.named_parameters():
            close(params[stage][name], expected.detach(), f"stage {stage} {name}")
            checked += 1
    assert checked >= len(list(model.parameters()))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "auto"])
def test_every_schedule_trains_to_the_plain_loop_parameters_in_float64(torch_cluster, schedule):
    losses, params, stages = _train_on_executors(torch_cluster, schedule, "float64",
                                                 name=f"gpt64-{schedule}")
    model, plain_losses = _train_plain(torch.float64)

    def close(got, want, where):
        diff = (got - want).abs().max().item()
        assert diff < 1e-10, f"{schedule}: {where} differs by {diff:.3g}"

    _assert_match(model, params, stages, close=close)
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def test_float32_training_matches_the_plain_loop_to_float32_precision(torch_cluster):
    _, params, stages = _train_on_executors(torch_cluster, "zb-h1", "float32", name="gpt32")
    model, _ = _train_plain(torch.float32)

    def close(got, want, where):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=where)

    _assert_match(model, params, stages, close=close)
