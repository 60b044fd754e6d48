"""A prompt's and a rollout's text survive every place that rebuilds them [Note: rollout text in
executors/torch/rollout/engine.py]: rewards, advantages, the simulator, partial-rollout
recomputation, the wire and a run checkpoint's codec."""

from __future__ import annotations

import pickle

from dataflows.rl.advantages import kl_token_rewards, reinforce_pp_advantages, rloo_advantages
from dataflows.rl.ops import (
    answer_reward,
    gae,
    grpo_advantages,
    make_experience,
    with_reference,
)
from executors.sim import ops as sim
from flowkit.ops.records import Prompt, Rollout, TokenScores, resumable
from flowkit.wire.serialize import pack, unpack

TEXTS = {"prompt_text": "<|im_start|>user\nQ<|im_end|>\n", "response_text": "4"}


def _rollout(sample: int = 0, **fields) -> Rollout:
    return Rollout(prompt_id=1, sample=sample, prompt_tokens=[5, 6], response_tokens=[52, 10],
                   logprobs=[-0.5, -0.25], versions=[0, 0], answer="4", **{**TEXTS, **fields})


def _texts(record) -> dict:
    return {"prompt_text": record.prompt_text, "response_text": record.response_text}


def test_rewards_and_advantages_keep_the_text():
    scored = [answer_reward.fn(_rollout(k)) for k in range(2)]
    scores = TokenScores(prompt_id=1, sample=0, values=[-0.5, -0.5])
    made = [make_experience.fn(scored[0], scores, scores), with_reference.fn(scored[0], scores),
            kl_token_rewards.fn(scored[0], scores), *grpo_advantages.fn(scored),
            *rloo_advantages.fn(scored), *reinforce_pp_advantages.fn(scored)]
    made += gae.fn(made[:1])
    assert all(_texts(record) == TEXTS for record in [*scored, *made])


def test_the_simulator_and_recomputed_partial_rollouts_keep_the_prompt_text():
    prompt = Prompt(prompt_id=1, tokens=[5, 6], answer="4", text=TEXTS["prompt_text"])
    drawn = sim.sample_rollout(prompt, 0, step=2)
    assert drawn.prompt_text == TEXTS["prompt_text"] and drawn.response_text is None
    carried = _rollout(interrupted=True, finished=False)
    continued, _ = sim._continued(carried, {"step": 2, "version": 1})
    assert continued.prompt_text == TEXTS["prompt_text"]
    (stale,) = resumable([_rollout()], min_version=1)  # its response is sampled again
    assert stale.prompt_text == TEXTS["prompt_text"] and stale.response_text is None


def test_the_wire_and_a_checkpoint_keep_the_text():
    rollout, prompt = _rollout(), Prompt(prompt_id=1, tokens=[5], text="hi")
    assert unpack(*pack([rollout, prompt])) == [rollout, prompt]
    assert pickle.loads(pickle.dumps(rollout)) == rollout
