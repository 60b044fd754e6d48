"""A verifiable task small enough for RL on two CPU cores: sorting digits.

The design: [Note: tasks], [Note: noisy warm-up], [Note: SFT targets] below.
"""

from __future__ import annotations

import random

import attrs

from flowkit.dsl import Stream, op
from flowkit.ops.records import Prompt, Rollout, Scored, TokenIds

__all__ = ["EOS", "SORT_GPT", "SORT_RESPONSE_TOKENS", "sort_answer", "sort_prompt_text",
           "sort_prompts", "sort_reward", "sort_sequences", "sft_targets"]


# [Note: tasks] Prompts are ``"sort 419:"``, the answer is ``"149"`` and a response is right only
# when it is exactly the answer and then EOS (``"149\n"``, byte 10). Text is byte-tokenized (token
# id = byte value, all below 128), so the built-in GPT needs no tokenizer and fits in vocab_size
# 128.
#
# Three ops: `sort_prompts` (the RL prompt source, fresh prompts every step), `sort_reward`
# (exact-match reward of one rollout) and `sort_sequences` (the supervised warm-up data: whole
# prompt + answer + "\n" sequences, one tensor each, the format of `dataflows.text.token_sequences`
# so a pretraining/SFT flow consumes them unchanged).
#
# [Note: noisy warm-up] RL here is meant to make the mean reward rise clearly (from about 0.15 to
# over 0.8) within a few dozen GRPO or PPO steps. Warm-up on correct demonstrations alone does not
# give that: stopped early, when sampling scores 0.1-0.3, the model is unsure of every token, and RL
# sharpens it slowly (a 4-digit study: 0.15 to about 0.3 in 60 GRPO steps; a larger learning rate
# collapses it). So the warm-up data imitates a noisy demonstrator: with `correct_fraction` = 0.2,
# four demonstrations in five sort the wrong way ("941\n"). Trained to convergence, the model sorts
# confidently both ways and picks ascending about a fifth of the time, which the exact-match reward
# alone can teach it to prefer: a few directions to learn, not every token's distribution. The
# curves this gives, each with its command: docs/performance.md, "RL rewards".
#
# [Note: SFT targets] The pipeline's "lm" loss cuts each sequence into inputs ``seq[:-1]`` and
# targets ``seq[1:]`` from one tensor, so a prompt position cannot be masked (a -1 there would also
# be an input token id): warm-up on these sequences is plain next-token prediction on the whole
# sequence, prompt digits included (they are random, so that part of the loss stays near log 10 per
# digit). A plain loop that can pass its own targets masks the prompt with `sft_targets`.

EOS = 10  # b"\n", the generator's default end of sequence
SORT_RESPONSE_TOKENS = 8
"""The task's response length, what its flows pass as max_new_tokens: the answer (3 digits in
the examples) and EOS, with room for a wrong answer to show itself."""
# the built-in GPT's config the task was tuned with [Note: noisy warm-up]; the longest sequence
# (3 digits) is 13 tokens, prompt 9 + response up to max_new_tokens 8 fits in 32
SORT_GPT = {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64}


def sort_prompt_text(digits: str) -> str:
    return f"sort {digits}:"


def sort_answer(digits: str) -> str:
    return "".join(sorted(digits))


def _draw(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(length))


@op
def sort_prompts(*, count: int = 16, seed: int = 0, step: int = 0, digits: int = 3,
                 pool: int | None = None) -> Stream[Prompt]:
    """`count` prompts "sort 419:" of `digits` random digits (repeats allowed), answer "149";
    the same for one (seed, step), different from step to step (the runtime passes `step`).
    `pool`: the prompts come in turn from a fixed set of that many (by `seed`), `count` a step,
    each with its place in the set as prompt_id, so that a prompt comes back with the same id
    (as a dataset's rows do, epoch after epoch): what adaptive sampling's history needs."""
    if pool is None:
        rng = random.Random(f"sort-prompts/{seed}/{step}")
        shown = [(prompt_id, _draw(rng, digits)) for prompt_id in range(count)]
    else:
        if not 1 <= count <= pool:
            raise ValueError(f"sort_prompts(pool={pool}) draws count={count} distinct prompts "
                             "a step from the pool: give 1 <= count <= pool")
        rng = random.Random(f"sort-pool/{seed}")
        every = [_draw(rng, digits) for _ in range(pool)]
        ids = [(step * count + k) % pool for k in range(count)]
        shown = [(prompt_id, every[prompt_id]) for prompt_id in ids]
    for prompt_id, digits_shown in shown:
        yield Prompt(prompt_id=prompt_id, tokens=list(sort_prompt_text(digits_shown).encode()),
                     answer=sort_answer(digits_shown))


@op
def sort_reward(rollout: Rollout) -> Scored:
    """1.0 when the response is exactly the answer then EOS ("149\\n"), else 0.0: trailing text,
    a missing EOS (cut at max_new_tokens) or any other difference scores 0, and so does a rollout
    without an answer to check."""
    answer = rollout.answer
    hit = bool(answer) and list(rollout.response_tokens) == list(answer.encode()) + [EOS]
    return Scored(**attrs.asdict(rollout, recurse=False), reward=1.0 if hit else 0.0)


@op
def sort_sequences(*, sequences: int = 64, seed: int = 0, step: int = 0, digits: int = 3,
                   correct_fraction: float = 1.0) -> Stream[TokenIds]:
    """`sequences` int64 tensors "sort 419:149\\n" (all the same length, 7 + 2 * digits),
    one item each, different every step and drawn apart from `sort_prompts`' prompts: inputs
    are seq[:-1], targets seq[1:] (see [Note: SFT targets]). With `correct_fraction` < 1 the
    demonstrations are noisy: each is, with probability 1 - correct_fraction, sorted the wrong
    way ("941\\n") [Note: noisy warm-up]."""
    import torch  # only executors run these ops; declaring a flow must not need torch

    rng = random.Random(f"sort-sft/{seed}/{step}")
    for _ in range(sequences):
        shown = _draw(rng, digits)
        answer = sort_answer(shown)
        if rng.random() >= correct_fraction:
            answer = answer[::-1]
        text = sort_prompt_text(shown) + answer + "\n"
        yield torch.tensor(list(text.encode()), dtype=torch.int64)


def sft_targets(sequences, prompt_len: int):
    """(inputs, targets) of a (B, T+1) batch of `sort_sequences` for a plain loop: targets of
    the prompt's positions are -1 (ignored by the GPT's loss), so only the answer and EOS are
    learned."""
    inputs, targets = sequences[:, :-1], sequences[:, 1:].clone()
    targets[:, : prompt_len - 1] = -1
    return inputs, targets

