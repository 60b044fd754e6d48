"""Minibatch rounds (PPO epochs) on torch executor processes equal a plain loop in float64.

A flow step trains its batch of Experiences for 2 epochs of 2 minibatches under a pipeline
schedule of 2 stages on 2 executors, 2 microbatches per minibatch: 4 optimizer steps. The plain
loop, on the unsplit model in this process, shuffles and cuts the batch by the same functions
(flowkit.ops.minibatch_rounds, cut), accumulates the microbatches' summed PPO losses, divides
by its minibatch's response tokens, clips by the global norm and takes an AdamW step, per
minibatch [Note: minibatch rounds in flowkit/ops/minibatches.py]. The old log-probs stay fixed,
so from the second round on the ratios move away from 1 and the clip bites (checked).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import attrs
import pytest
import torch

from dataflows.model_ops import Backprop, LogProbs, OptimizerStep
from dataflows.models import GPT_BUILD
from flowkit.dsl import Flow, Model, Stream, collect, op
from flowkit.ops import cut, minibatch_rounds
from flowkit.ops.records import Experience, StepMetrics
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.training_tasks import model_spec
from tests.harness import seeded_gpt, tiny_gpt
from tests.rl.reference_algos import ppo_policy_loss, ppo_policy_loss_stats
from tests.torch.helpers import padded_batch, response_logprobs

GPT_CONFIG = tiny_gpt()
SEED = 7
ITEMS, EPOCHS, MINIBATCHES, MICROBATCHES, STEPS = 10, 2, 2, 2, 2
LOSS = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}
# lr large enough that one round moves the ratios well past the clip range
STEP = {"lr": 1e-2, "clip_grad_norm": 1.0}
TIGHT = 1e-10


@op
def experiences(*, count: int = ITEMS, step: int = 0) -> Stream[Experience]:
    """A step's batch, the same in every process: old log-probs near the fresh tiny GPT's
    (about -log(64): its logits start near zero), so the first round's ratios are near 1."""
    rng = random.Random(f"ppo-epochs/{step}")
    for i in range(count):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 5))]
        response = [rng.randrange(64) for _ in range(rng.randint(1, 6))]
        yield Experience(prompt_id=i, sample=0, prompt_tokens=prompt, response_tokens=response,
                         logprobs=[-math.log(64) + rng.gauss(0.0, 0.05) for _ in response],
                         reward=0.0, advantages=[rng.gauss(0.0, 1.0) for _ in response])


def _flow(name: str) -> Flow:
    actor = Model(name=name, build=GPT_BUILD, stages=2, tags=("train",),
                  config={**GPT_CONFIG, "dtype": "float64", "seed": SEED})
    with Flow("ppo_rounds") as flow:
        batch = experiences()
        stats = Backprop(actor)(batch, loss="ppo", microbatches=MICROBATCHES, epochs=EPOCHS,
                                minibatches=MINIBATCHES, name="update_actor", **LOSS)
        OptimizerStep(actor)(collect(stats), name="actor_step", **STEP)
        # a user of the actor on another executor: the weights go there after the last round
        LogProbs(actor, tags=("rollout",))(batch)
    return flow


def _train(ctl, tmp_path: Path, schedule: str, replicas: int = 1) -> tuple:
    flow = _flow(f"actor-{schedule}")
    flow.nodes["update_actor"].config["schedule"] = schedule
    flow.models[f"actor-{schedule}"] = attrs.evolve(flow.models[f"actor-{schedule}"],
                                                    replicas=replicas)
    runner = FlowRunner(ctl, lower_flow(flow))
    reports = [runner.run_step(step) for step in range(STEPS)]
    (path,) = runner.save_weights(tmp_path / schedule)
    (metrics,) = runner.previous[("actor_step", "metrics")].ordered()
    rollout = next(e for e in ctl.executors() if "rollout" in e.tags)
    synced = ctl.submit("export_weights", config={**model_spec(flow.models[f"actor-{schedule}"],
                                                               1), "stage": 0},
                        executor=rollout.id).result(timeout=60)
    return torch.load(path, weights_only=True), synced, metrics.result(timeout=60), reports


def _train_plain() -> tuple:
    """The reference loop; returns the model, the last step's report as the flow's should
    read, the clip fraction of each microbatch after the first round, each round's norm."""
    model = seeded_gpt(GPT_CONFIG, seed=SEED, dtype=torch.float64)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
        lr=STEP["lr"], betas=(0.9, 0.95), foreach=False)
    clipfracs, all_norms, report = [], [], None
    for step in range(STEPS):
        batch = list(experiences.fn(step=step))
        rounds = minibatch_rounds(len(batch), epochs=EPOCHS, minibatches=MINIBATCHES, seed=0,
                                  step=step)
        losses, norms = [], []  # per round: (summed loss, tokens), the gradient norm
        for index, indices in enumerate(rounds):
            minibatch = [batch[i] for i in indices]
            summed, tokens = 0.0, sum(len(e.response_tokens) for e in minibatch)
            for part in cut(minibatch, MICROBATCHES):
                loss, clipfrac = _summed_policy_loss(model, part)
                loss.backward()
                summed += loss.item()
                if index:
                    clipfracs.append(clipfrac)
            for p in model.parameters():
                p.grad.div_(tokens)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                        STEP["clip_grad_norm"]).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append((summed, tokens))
        all_norms += norms
        tokens = sum(t for _, t in losses)
        report = StepMetrics(step=step, loss=sum(s for s, _ in losses) / tokens,
                             grad_norm=sum(norms) / len(norms), tokens=tokens,
                             optimizer_steps=len(rounds))
    return model, report, clipfracs, all_norms


def _summed_policy_loss(model, part: list[Experience]) -> tuple[torch.Tensor, float]:
    """verl's token-mean PPO loss times the tokens: the sum the pipeline backpropagates."""
    ids, positions, tokens, mask, f = padded_batch(part, ["logprobs", "advantages"])
    logp = response_logprobs(model, ids, positions, tokens)
    loss = ppo_policy_loss(f["logprobs"], logp, f["advantages"], mask, agg="token-mean", **LOSS)
    stats = ppo_policy_loss_stats(f["logprobs"], logp, f["advantages"], mask, **LOSS)
    return loss * mask.sum(), stats["clipfrac"].item()


@pytest.fixture(scope="module")
def cluster(pool):
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags, code=[__file__]) as (ctl, _):
        yield ctl


@pytest.fixture(scope="module")
def plain():
    return _train_plain()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_rounds_train_to_the_plain_loops_parameters(cluster, plain, tmp_path, schedule):
    _assert_plain(_train(cluster, tmp_path, schedule), plain, schedule)


def test_two_replicas_train_the_rounds_to_the_plain_loops_parameters(pool, plain, tmp_path):
    """Each round's 2 microbatches, one on each replica, and its optimizer step on both
    [Note: replicas in flowkit/runner/replicas.py]."""
    tags = [("train",)] * 4 + [("rollout",)]
    with pool.shared(5, kind="torch", tags=tags, code=[__file__]) as (ctl, _):
        _assert_plain(_train(ctl, tmp_path, "1f1b", replicas=2), plain, "1f1b x 2 replicas")


def _assert_plain(run: tuple, plain: tuple, schedule: str) -> None:
    trained, synced, metrics, reports = run
    model, want, _, _ = plain
    expected = model.state_dict()
    assert set(trained) <= set(expected) and len(trained) >= len(list(model.parameters()))
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=TIGHT,
                                   msg=f"{schedule}: {name} differs")
        # the rollout executor got the last round's weights, not an earlier round's
        torch.testing.assert_close(synced[name], tensor, rtol=0, atol=0)
    assert metrics.optimizer_steps == want.optimizer_steps == EPOCHS * MINIBATCHES
    assert metrics.tokens == want.tokens
    assert metrics.loss == pytest.approx(want.loss, abs=TIGHT)
    assert metrics.grad_norm == pytest.approx(want.grad_norm, abs=TIGHT)
    assert all(r.metrics["update_actor/optimizer_steps"] == 4 for r in reports)


def test_the_plain_loop_sees_clipping_after_the_first_round(plain):
    """What makes the comparison above mean something: later rounds' ratios leave the clip
    range (the old log-probs are fixed), and some round's gradient is clipped."""
    _, _, clipfracs, norms = plain
    assert max(clipfracs) > 0.1
    assert max(norms) > STEP["clip_grad_norm"]
