"""LoRA through the pipeline [Note: LoRA in flowkit/dsl/lora.py]: a built-in GPT with adapters,
trained by pipeline schedules (1F1B and the V shape) on torch executor processes (F/B/W, the
adapters' weight gradients deferred to W), ends with the parameters of a plain single-process
loop over the same model with the same adapters, to 1e-10 in float64; the base weights never
move, and a weight export carries the adapters only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataflows.pretrain import pretrain_flow
from executors.torch import weights
from executors.torch.lora import add_adapters
from flowkit.dsl import Model
from tests.harness import (
    per_stage,
    plain_training,
    seeded_gpt,
    tiny_gpt,
    trained_on_executors,
)

CORPUS = str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt")
DEVICES, MICROBATCHES, SEQUENCES, SEQ_LEN, STEPS, SEED = 2, 4, 8, 8, 2, 3
GPT_CONFIG = tiny_gpt(vocab_size=256, block_size=16, n_layer=4, n_embd=16)
LORA = {"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_fc"]}
HPARAMS = {"lr": 1e-2, "clip_grad_norm": 0.5}


def lora_gpt(name: str, *, dtype: str = "float64", lora: dict | None = None) -> Model:
    return Model(name=name, build="executors.torch.models.gpt:GPT",
                 config={**GPT_CONFIG, "dtype": dtype, "seed": SEED}, stages=DEVICES,
                 tags=("train",), lora=LORA if lora is None else lora)


@pytest.fixture(scope="module")
def torch_cluster(pool):
    with pool.shared(DEVICES, kind="torch", tags=("train",)) as (ctl, _):
        yield ctl


def _train_on_executors(ctl, schedule: str, name: str, lora: dict | None = None,
                        dtype: str = "float64") -> tuple[list, dict, dict, int]:
    flow = pretrain_flow(model=lora_gpt(name, lora=lora, dtype=dtype), corpus=CORPUS,
                         microbatches=MICROBATCHES, schedule=schedule, batch_size=SEQUENCES,
                         seq_len=SEQ_LEN, **HPARAMS)
    losses, runner = trained_on_executors(ctl, flow, name, STEPS)
    params = per_stage(ctl, runner, name, "stage_parameters")
    exported = {}
    for stage_weights in per_stage(ctl, runner, name, "export_weights").values():
        exported.update(stage_weights)
    return losses, params, exported, len(params)


def plain_lora_gpt(dtype=torch.float64, targets=LORA["target_modules"]):
    """The reference model: the GPT built as its holders build it, adapters injected as they
    inject them (the model's seed again, right before)."""
    model = seeded_gpt(GPT_CONFIG, seed=SEED, dtype=dtype)
    torch.manual_seed(SEED)
    add_adapters(model, [model], weights.layout(model), {
        "r": 4, "alpha": 8.0, "target_modules": targets, "dropout": 0.0, "save": "adapter"})
    return model


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])  # zb-h1: tests/lora/test_lora_hf.py
def test_lora_training_equals_the_plain_loop(torch_cluster, schedule):
    losses, params, exported, stages = _train_on_executors(torch_cluster, schedule,
                                                           f"lora-{schedule}")
    model = plain_lora_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    plain_losses = plain_training(trained, lambda b: model(b[:, :-1], b[:, 1:]), corpus=CORPUS,
                                  steps=STEPS, sequences=SEQUENCES, seq_len=SEQ_LEN,
                                  microbatches=MICROBATCHES, **HPARAMS)
    assert losses == pytest.approx(plain_losses, abs=1e-10)
    for stage, module in enumerate(model.split(stages)):
        for name, want in module.named_parameters():
            diff = (params[stage][name] - want.detach()).abs().max().item()
            assert diff < 1e-10, f"{schedule}: stage {stage} {name} differs by {diff:.3g}"
    wanted = dict(model.named_parameters())
    adapters = {n for n, p in wanted.items() if p.requires_grad}
    assert set(exported) == adapters  # only the adapters leave a LoRA split
    for name in adapters:
        diff = (exported[name] - wanted[name].detach()).abs().max().item()
        assert diff < 1e-10, f"{schedule}: {name} differs by {diff:.3g}"
        assert not torch.equal(exported[name], before[name]), f"{name} never trained"


def test_a_stage_without_adapters_steps_nothing_and_the_rest_trains(torch_cluster):
    """Adapters on the last two blocks only: stage 0 (blocks 0 and 1) holds none."""
    targets = ["h.2.mlp.c_fc", "h.3.mlp.c_fc"]
    losses, params, exported, stages = _train_on_executors(
        torch_cluster, "1f1b", "lora-top", lora={**LORA, "target_modules": targets})
    model = plain_lora_gpt(targets=targets)
    trained = [p for p in model.parameters() if p.requires_grad]
    plain_losses = plain_training(trained, lambda b: model(b[:, :-1], b[:, 1:]), corpus=CORPUS,
                                  steps=STEPS, sequences=SEQUENCES, seq_len=SEQ_LEN,
                                  microbatches=MICROBATCHES, **HPARAMS)
    assert losses == pytest.approx(plain_losses, abs=1e-10)
    assert sorted(exported) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    for stage, module in enumerate(model.split(stages)):
        for name, want in module.named_parameters():
            assert (params[stage][name] - want.detach()).abs().max().item() < 1e-10, name


def test_a_bfloat16_models_adapters_train_in_float32(torch_cluster):
    """peft's autocast_adapter_dtype: a bfloat16 GPT's adapters are float32 on the executors and
    in what leaves them, so steps smaller than bfloat16's spacing near the adapters' values (2e-3
    at 0.3) are kept; the base weights stay bfloat16. The plain loop in bfloat16 with float32
    adapters reaches the same losses and adapters bit for bit."""
    losses, params, exported, stages = _train_on_executors(torch_cluster, "1f1b", "lora-bf16",
                                                           dtype="bfloat16")
    model = plain_lora_gpt(dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}
    plain_losses = plain_training(trained, lambda b: model(b[:, :-1], b[:, 1:]), corpus=CORPUS,
                                  steps=STEPS, sequences=SEQUENCES, seq_len=SEQ_LEN,
                                  microbatches=MICROBATCHES, **HPARAMS)
    assert losses == plain_losses
    wanted = dict(model.named_parameters())
    assert sorted(exported) == sorted(n for n, p in wanted.items() if p.requires_grad)
    for name, value in exported.items():
        assert value.dtype == torch.float32 and torch.equal(value, wanted[name].detach()), name
        assert not torch.equal(value, before[name]), f"{name} never trained"
    for stage, module in enumerate(model.split(stages)):
        for name, want in module.named_parameters():
            assert torch.equal(params[stage][name], want.detach()), name
