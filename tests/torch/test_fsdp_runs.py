"""FSDP within a stage on real torch executor processes [Note: FSDP within a stage in
executors/torch/train/fsdp.py]: D = 2 replicas of a P-stage pipeline, each stage's parameters,
gradients and AdamW states cut over its replicas between steps, train what one process trains
on the unsplit model (float64, 5 steps, 1e-10), under a fused and a split (B/W) backward; and
each replica keeps about half of the stage's state bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataflows.pretrain import pretrain_flow
from executors.torch.train.fsdp import full_stage_state
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.setup import with_training_options
from tests.harness import plain_training, seeded_gpt, tiny_gpt

CORPUS = str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt")
REPLICAS, SEQ_LEN, STEPS, MICROBATCHES, SEQUENCES = 2, 8, 5, 4, 8
GPT_CONFIG = tiny_gpt(vocab_size=256, block_size=16, n_layer=4, n_embd=16)
HPARAMS = {"lr": 1e-2, "clip_grad_norm": 0.5}  # small enough a norm that clipping happens


@pytest.fixture(scope="module")
def cluster(pool):
    with pool.shared(4, kind="torch", tags=("train",), code=[__file__]) as (ctl, _):
        yield ctl


def _flow(name: str, *, stages: int, schedule: str, fsdp: bool = True):
    flow = pretrain_flow(corpus=CORPUS, stages=stages, microbatches=MICROBATCHES,
                         schedule=schedule, batch_size=SEQUENCES, seq_len=SEQ_LEN,
                         gpt={**GPT_CONFIG, "dtype": "float64", "seed": 3}, model_name=name,
                         **HPARAMS)
    return with_training_options(flow, stages=None, microbatches=None, schedule=None,
                                 replicas=REPLICAS, fsdp=fsdp)


def _train(ctl, flow, name: str, steps: int = STEPS) -> tuple[list, FlowRunner]:
    runner = FlowRunner(ctl, lower_flow(flow))
    losses = [runner.run_step(step).metrics["backprop/loss"] for step in range(steps)]
    return losses, runner


def _on_each_replica(ctl, runner: FlowRunner, name: str, op: str) -> list[dict]:
    """`op`'s answer for every stage, on every replica: [replica][stage]."""
    schedule, spec = runner.trained[name]
    training = runner.training[name]
    return [{stage: ctl.submit(op, config={**spec, "stage": stage},
                               executor=training.replica(r)[schedule.placement.device_of(stage)]
                               .id).result(timeout=60)
             for stage in range(schedule.num_stages)} for r in range(REPLICAS)]


def _plain():
    model = seeded_gpt(GPT_CONFIG, seed=3, dtype=torch.float64)
    losses = plain_training(model.parameters(), lambda b: model(b[:, :-1], b[:, 1:]),
                            corpus=CORPUS, steps=STEPS, sequences=SEQUENCES, seq_len=SEQ_LEN,
                            microbatches=MICROBATCHES, **HPARAMS)
    return model, losses


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fsdp_over_two_replicas_of_two_stages_trains_to_the_plain_loop(cluster, schedule):
    name = f"fsdp-{schedule}"
    losses, runner = _train(cluster, _flow(name, stages=2, schedule=schedule), name)
    shares = _on_each_replica(cluster, runner, name, "fsdp_shards")
    model, plain_losses = _plain()
    checked = 0
    for stage, module in enumerate(model.split(2)):
        params, _ = full_stage_state([shares[r][stage] for r in range(REPLICAS)])
        for param_name, expected in module.named_parameters():
            diff = (params[param_name] - expected.detach()).abs().max().item()
            assert diff < 1e-10, f"{schedule}: stage {stage} {param_name} differs by {diff:.3g}"
            checked += 1
        # each replica held rows of the stage, not all of it
        assert any(p.shape != shares[0][stage]["params"][n].shape for n, p in params.items())
    assert checked >= len(list(model.parameters()))
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def test_each_fsdp_replica_keeps_about_half_of_the_state_bytes(cluster):
    """Parameters, the gradients the optimizer steps and its AdamW states, per replica, against
    replicas that keep the whole stage (one stage: no tied copy stays whole)."""
    per_replica = {}
    for fsdp in (True, False):
        name = f"fsdp-bytes-{fsdp}"
        _, runner = _train(cluster, _flow(name, stages=1, schedule="1f1b", fsdp=fsdp), name,
                           steps=1)
        per_replica[fsdp] = [sum(b[0].values()) for b in
                             _on_each_replica(cluster, runner, name, "stage_state_bytes")]
    whole = per_replica[False]
    assert whole[0] == whole[1] > 0
    for sharded in per_replica[True]:
        assert 0.45 * whole[0] <= sharded <= 0.55 * whole[0], (sharded, whole[0])


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fsdp_over_two_replicas_of_an_hf_llama_trains_to_the_plain_hf_loop(cluster, schedule):
    """A Hugging Face Llama (GQA, rotary), one stage, two replicas."""
    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    from flowkit.dsl import Model
    from tests.torch import test_hf_models as hf

    name = f"fsdp-llama-{schedule}"
    model = Model(name=name, build="hf", config={**hf.LLAMA, "dtype": "float64", "seed": 3},
                  stages=1, replicas=REPLICAS, shard="fsdp", tags=("train",))
    flow = pretrain_flow(model=model, corpus=CORPUS, microbatches=hf.MICROBATCHES,
                         schedule=schedule, batch_size=hf.SEQUENCES, seq_len=hf.SEQ_LEN,
                         **HPARAMS)
    losses, runner = _train(cluster, flow, name, steps=hf.STEPS)
    shares = _on_each_replica(cluster, runner, name, "fsdp_shards")
    params, _ = full_stage_state([shares[r][0] for r in range(REPLICAS)])
    lm, plain_losses = hf._train_plain(hf.LLAMA, torch.float64)

    def close(got, want, where):
        diff = (got - want).abs().max().item()
        assert diff < 1e-10, f"{name}: {where} differs by {diff:.3g}"

    hf._assert_match(lm, params, close)
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def test_fsdp_over_two_replicas_trains_lora_adapters_to_the_plain_loop(cluster):
    """LoRA adapters (r = 4 rows or columns: each sharded over 2) on 2 stages; the frozen base
    weights are not trained, and stay whole."""
    from flowkit.dsl import Model
    from tests.lora import test_lora_pipeline as lora

    name = "fsdp-lora"
    model = Model(name=name, build="executors.torch.models.gpt:GPT",
                  config={**lora.GPT_CONFIG, "dtype": "float64", "seed": lora.SEED}, stages=2,
                  replicas=REPLICAS, shard="fsdp", tags=("train",), lora=lora.LORA)
    flow = pretrain_flow(model=model, corpus=CORPUS, microbatches=lora.MICROBATCHES,
                         schedule="1f1b", batch_size=lora.SEQUENCES, seq_len=lora.SEQ_LEN,
                         **HPARAMS)
    losses, runner = _train(cluster, flow, name, steps=lora.STEPS)
    shares = _on_each_replica(cluster, runner, name, "fsdp_shards")
    plain = lora.plain_lora_gpt()
    trained = [p for p in plain.parameters() if p.requires_grad]
    plain_losses = plain_training(trained, lambda b: plain(b[:, :-1], b[:, 1:]), corpus=CORPUS,
                                  steps=lora.STEPS, sequences=lora.SEQUENCES,
                                  seq_len=lora.SEQ_LEN, microbatches=lora.MICROBATCHES, **HPARAMS)
    assert losses == pytest.approx(plain_losses, abs=1e-10)
    checked = 0
    for stage, module in enumerate(plain.split(2)):
        params, _ = full_stage_state([shares[r][stage] for r in range(REPLICAS)])
        assert params and all("lora" in n for n in params)  # the adapters alone
        for param_name, want in module.named_parameters():
            if param_name in params:
                diff = (params[param_name] - want.detach()).abs().max().item()
                assert diff < 1e-10, f"stage {stage} {param_name} differs by {diff:.3g}"
                checked += 1
    assert checked == len(trained)


# A model whose one parameter is a single row of logits: nothing for FSDP to cut over 2.
_ONE_ROW = '''
import torch
import torch.nn.functional as F


class OneRow(torch.nn.Module):
    def __init__(self, vocab_size=256):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(1, vocab_size))

    def forward(self, tokens, targets=None):
        logits = self.logits.expand(*tokens.shape, -1)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
'''


def test_a_stage_fsdp_cannot_shard_is_refused_before_the_models_first_op(pool, tmp_path):
    from flowkit.dsl import Model
    from flowkit.runner.flowrun import FlowRunError

    path = tmp_path / "fsdp_one_row.py"
    path.write_text(_ONE_ROW)
    model = Model(name="one-row", build="fsdp_one_row:OneRow", config={"dtype": "float64"},
                  replicas=REPLICAS, shard="fsdp", tags=("train",))
    flow = pretrain_flow(model=model, corpus=CORPUS, microbatches=MICROBATCHES,
                         schedule="1f1b", batch_size=SEQUENCES, seq_len=SEQ_LEN, **HPARAMS)
    with pool.shared(2, kind="torch", tags=("train",), code=[str(path)]) as (ctl, _):
        runner = FlowRunner(ctl, lower_flow(flow))
        with pytest.raises(FlowRunError) as raised:
            runner.run_step(0)
    first = str(raised.value).splitlines()[0]  # the check before any F, not the first reduce
    assert "op 'fsdp_check' failed" in first, first
    assert "finds no parameter to shard (trainable: logits;" in first, first
