"""Data parallel × pipeline parallel on real torch executor processes equals a plain loop.

A model trained as D = 2 replicas of a P-device pipeline (P = 2: 4 executor processes; P = 1: 2)
sums its replicas' gradients through torch.distributed (gloo) [Note: replicas in
flowkit/runner/replicas.py]; whatever the schedule, the parameters and per-step losses equal one
process training the unsplit model on the same global batch, to 1e-10 in float64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataflows.pretrain import pretrain_flow
from flowkit.dsl import Stream, op
from flowkit.ops.records import TokenIds
from flowkit.planner.lower import lower_flow
from flowkit.runner.config import RunConfigError
from flowkit.runner.flowrun import FlowRunError, FlowRunner
from flowkit.runner.setup import with_training_options
from tests.harness import plain_training, seeded_gpt, tiny_gpt

CORPUS = str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt")
REPLICAS, SEQ_LEN, STEPS = 2, 8, 2
GPT_CONFIG = tiny_gpt(vocab_size=256, block_size=16, n_layer=4, n_embd=16)
HPARAMS = {"lr": 1e-2, "clip_grad_norm": 0.5}  # small enough a norm that clipping happens


@pytest.fixture(scope="module")
def cluster(pool):
    with pool.shared(4, kind="torch", tags=("train",), code=[__file__]) as (ctl, _):
        yield ctl


def _flow(name: str, *, stages: int, schedule: str, microbatches: int, sequences: int,
          dtype: str = "float64", shard_optimizer: bool = False):
    flow = pretrain_flow(corpus=CORPUS, stages=stages, microbatches=microbatches,
                         schedule=schedule, batch_size=sequences, seq_len=SEQ_LEN,
                         gpt={**GPT_CONFIG, "dtype": dtype, "seed": 3}, model_name=name,
                         **HPARAMS)
    return with_training_options(flow, stages=None, microbatches=None, schedule=None,
                                 replicas=REPLICAS, shard_optimizer=shard_optimizer)


def _train(ctl, flow, name: str) -> tuple[list, list[dict]]:
    """Per-step losses, and every replica's parameters by stage."""
    runner = FlowRunner(ctl, lower_flow(flow))
    losses = [runner.run_step(step).metrics["backprop/loss"] for step in range(STEPS)]
    schedule, spec = runner.trained[name]
    training = runner.training[name]
    replicas = []
    for replica in range(REPLICAS):
        executors = training.replica(replica)
        replicas.append({stage: ctl.submit(
            "stage_parameters", config={**spec, "stage": stage},
            executor=executors[schedule.placement.device_of(stage)].id).result(timeout=60)
            for stage in range(schedule.num_stages)})
    return losses, replicas


def _plain(*, microbatches: int, sequences: int) -> tuple:
    model = seeded_gpt(GPT_CONFIG, seed=3, dtype=torch.float64)
    losses = plain_training(model.parameters(), lambda b: model(b[:, :-1], b[:, 1:]),
                            corpus=CORPUS, steps=STEPS, sequences=sequences, seq_len=SEQ_LEN,
                            microbatches=microbatches, **HPARAMS)
    return model, losses


def _assert_equal(model, params: dict, stages: int, where: str) -> None:
    checked = 0
    for stage, module in enumerate(model.split(stages)):
        for name, expected in module.named_parameters():
            diff = (params[stage][name] - expected.detach()).abs().max().item()
            assert diff < 1e-10, f"{where}: stage {stage} {name} differs by {diff:.3g}"
            checked += 1
    assert checked >= len(list(model.parameters()))


@pytest.mark.parametrize("stages", [2, 1])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-v"])
def test_two_replicas_train_to_the_plain_loop_in_float64(cluster, schedule, stages):
    name = f"dp-{schedule}-{stages}"
    flow = _flow(name, stages=stages, schedule=schedule, microbatches=4, sequences=8)
    losses, replicas = _train(cluster, flow, name)
    model, plain_losses = _plain(microbatches=4, sequences=8)
    schedule_stages = len(replicas[0])
    for replica, params in enumerate(replicas):
        _assert_equal(model, params, schedule_stages, f"{schedule}, replica {replica}")
    assert losses == pytest.approx(plain_losses, abs=1e-10)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_sharded_optimizer_states_train_to_the_plain_loop(cluster, schedule):
    """ZeRO-1: each replica steps its half of each stage's parameters and broadcasts them."""
    name = f"dp-zero-{schedule}"
    flow = _flow(name, stages=2, schedule=schedule, microbatches=4, sequences=8,
                 shard_optimizer=True)
    losses, replicas = _train(cluster, flow, name)
    model, plain_losses = _plain(microbatches=4, sequences=8)
    for replica, params in enumerate(replicas):
        _assert_equal(model, params, len(params), f"{schedule}, replica {replica}")
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def test_uneven_microbatch_counts_per_replica(cluster):
    """5 microbatches over 2 replicas: 3 on the first, 2 on the second."""
    flow = _flow("dp-uneven", stages=2, schedule="1f1b", microbatches=5, sequences=10)
    losses, replicas = _train(cluster, flow, "dp-uneven")
    model, plain_losses = _plain(microbatches=5, sequences=10)
    for replica, params in enumerate(replicas):
        _assert_equal(model, params, 2, f"replica {replica}")
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def test_fewer_microbatches_than_replicas_fail_before_anything_starts():
    with pytest.raises(RunConfigError, match="at least 2"):
        _flow("dp-few", stages=2, schedule="1f1b", microbatches=1, sequences=8)


def test_too_few_executors_for_the_replicas_is_a_clear_error(cluster):
    flow = pretrain_flow(corpus=CORPUS, stages=2, microbatches=4, batch_size=8, seq_len=SEQ_LEN,
                         gpt={**GPT_CONFIG, "seed": 3}, model_name="dp-many")
    flow = with_training_options(flow, stages=None, microbatches=None, schedule=None,
                                 replicas=3)
    with pytest.raises(FlowRunError, match="needs 6 executors"):
        FlowRunner(cluster, lower_flow(flow))


@pytest.mark.parametrize(("architecture", "schedule", "stages"), [
    *(("llama", kind, 2) for kind in ("gpipe", "1f1b", "zb-h1", "zb-v")),
    ("llama", "1f1b", 1), ("qwen2-tied", "1f1b", 2), ("qwen2-tied", "zb-v", 2)])
def test_two_replicas_of_an_hf_model_train_to_the_plain_hf_loop(cluster, architecture,
                                                                 schedule, stages):
    """A Hugging Face Llama, and a Qwen2 whose tied head is a copy on the last stage."""
    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    from flowkit.dsl import Model
    from tests.torch import test_hf_models as hf

    config = {"llama": hf.LLAMA, "qwen2-tied": hf.QWEN2_TIED}[architecture]
    name = f"dp-{architecture}-{schedule}-{stages}"
    model = Model(name=name, build="hf", config={**config, "dtype": "float64", "seed": 3},
                  stages=stages, replicas=REPLICAS, tags=("train",))
    flow = pretrain_flow(model=model, corpus=CORPUS, microbatches=hf.MICROBATCHES,
                         schedule=schedule, batch_size=hf.SEQUENCES, seq_len=hf.SEQ_LEN,
                         **HPARAMS)
    losses, replicas = _train(cluster, flow, name)
    lm, plain_losses = hf._train_plain(config, torch.float64)

    def close(got, want, where):
        diff = (got - want).abs().max().item()
        assert diff < 1e-10, f"{name}: {where} differs by {diff:.3g}"

    for params in replicas:
        hf._assert_match(lm, {k: v for stage in params.values() for k, v in stage.items()},
                         close)
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def test_a_run_on_shared_executors_leaves_its_replica_groups(cluster):
    """The executors outlive the run: its process groups end with it."""
    from rich.console import Console

    from flowkit import Run, RunConfig

    flow = _flow("dp-leave", stages=1, schedule="1f1b", microbatches=2, sequences=4)
    with Run(flow, RunConfig(dashboard=False, steps=1), controller=cluster,
             console=Console(quiet=True)) as run:
        list(run.steps())
        training = run.runner.training["dp-leave"]
    assert training.groups
    left = [cluster.submit("leave_replica_groups", config={"groups": training.groups},
                           executor=e.id).result(timeout=30) for e in training.executors]
    assert left == [0, 0]


@op
def masked_rows(*, sequences: int = 10, step: int = 0) -> Stream[TokenIds]:
    """Rows of SEQ_LEN + 1 tokens whose first 1-4 (a prompt) and last 0-3 (padding) are
    masked (~t: read, never a target), so microbatches count different numbers of targets."""
    import random

    rng = random.Random(f"masked/{step}")
    for _ in range(sequences):
        row = [rng.randrange(256) for _ in range(SEQ_LEN + 1)]
        prompt, padding = rng.randint(1, 4), rng.randint(0, 3)
        row = [~t if i < prompt or i > SEQ_LEN - padding else t for i, t in enumerate(row)]
        yield torch.tensor(row, dtype=torch.int64)


def test_masked_tokens_train_on_two_replicas_as_on_one(cluster):
    """5 microbatches of rows with masked tokens: 2 replicas train what 1 does (1e-10)."""
    results = []
    for replicas in (1, 2):
        name = f"dp-masked-{replicas}"
        flow = pretrain_flow(source=masked_rows, stages=2, microbatches=5, schedule="zb-h1",
                             batch_size=10, gpt={**GPT_CONFIG, "dtype": "float64", "seed": 3},
                             model_name=name, **HPARAMS)
        flow = with_training_options(flow, stages=None, microbatches=None, schedule=None,
                                     replicas=replicas)
        runner = FlowRunner(cluster, lower_flow(flow))
        losses = [runner.run_step(step).metrics["backprop/loss"] for step in range(STEPS)]
        schedule, spec = runner.trained[name]
        executors = runner.training[name].replica(0)
        params = {stage: cluster.submit(
            "stage_parameters", config={**spec, "stage": stage},
            executor=executors[schedule.placement.device_of(stage)].id).result(timeout=60)
            for stage in range(schedule.num_stages)}
        results.append((losses, params))
    (one_losses, one), (two_losses, two) = results
    assert two_losses == pytest.approx(one_losses, abs=1e-10)
    for stage, params in one.items():
        for name, want in params.items():
            diff = (two[stage][name] - want).abs().max().item()
            assert diff < 1e-10, f"stage {stage} {name} differs by {diff:.3g}"
