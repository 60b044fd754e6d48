"""Your own task, end to end (docs/your-own-task.md walks through it): reverse three digits,
"rev 419:" -> "914". Three ops of your own and two flows from `dataflows`:

    flowkit run examples/reverse_task.py:warmup --steps 300 --save-weights checkpoints
    flowkit run examples/reverse_task.py --steps 20 --metrics reverse.jsonl

Text is byte-tokenized (token id = byte value), so the built-in GPT needs no tokenizer. The
`--8<--` comments mark what the page shows of this file.
"""

import random

import attrs

from dataflows.grpo import grpo_flow
from dataflows.pretrain import pretrain_flow
from flowkit.dsl import Stream, op
from flowkit.ops.records import Prompt, Rollout, Scored, TokenIds

EOS = 10  # b"\n": the built-in GPT's generation stops at it
GPT = {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64}


def _digits(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(3))


# --8<-- [start:prompts]
@op
def reverse_prompts(*, count: int = 16, seed: int = 0, step: int = 0) -> Stream[Prompt]:
    """`count` prompts "rev 419:", answer "914"; new ones every step (the runner passes
    `step`), the same ones for a (seed, step)."""
    rng = random.Random(f"reverse/{seed}/{step}")
    for prompt_id in range(count):
        digits = _digits(rng)
        yield Prompt(prompt_id=prompt_id, tokens=list(f"rev {digits}:".encode()),
                     answer=digits[::-1])
# --8<-- [end:prompts]


# --8<-- [start:reward]
@op
def reverse_reward(rollout: Rollout) -> Scored:
    """1.0 when the response is exactly the answer and then EOS ("914\\n"), else 0.0."""
    hit = rollout.response_tokens == list(rollout.answer.encode()) + [EOS]
    # a Scored is its Rollout's fields and a reward: copy them over, not one by one
    return Scored(**attrs.asdict(rollout, recurse=False), reward=1.0 if hit else 0.0)
# --8<-- [end:reward]


# --8<-- [start:warmup_data]
@op
def reverse_sequences(*, sequences: int = 64, seed: int = 0, step: int = 0,
                      correct_fraction: float = 0.2) -> Stream[TokenIds]:
    """Warm-up data, "rev 419:914\\n": only `correct_fraction` of the demonstrations reverse,
    the rest copy the digits ("rev 419:419\\n"), so the warmed-up model knows the format but
    is mostly wrong, and RL has something to teach."""
    import torch  # only the executors run this op: declaring the flow needs no torch

    rng = random.Random(f"reverse-warmup/{seed}/{step}")
    for _ in range(sequences):
        digits = _digits(rng)
        shown = digits[::-1] if rng.random() < correct_fraction else digits
        yield torch.tensor(list(f"rev {digits}:{shown}\n".encode()), dtype=torch.int64)
# --8<-- [end:warmup_data]


# --8<-- [start:warmup]
# The supervised warm-up: next-token prediction on the demonstrations, the GPT in 2 stages.
warmup = pretrain_flow(source=reverse_sequences, batch_size=64, stages=2, microbatches=4,
                       gpt=GPT, lr=2e-3, model_name="actor", name="reverse_warmup")
# --8<-- [end:warmup]

# --8<-- [start:flow]
# GRPO from the warm-up's weights: 16 prompts x 8 samples a step, the actor in 2 stages.
flow = grpo_flow(prompts=16, n=8, stages=2, microbatches=4, max_new_tokens=8, lr=3e-4,
                 kl_coef=0.001, prompt_source=reverse_prompts, reward=reverse_reward,
                 gpt={**GPT, "checkpoint": "checkpoints/actor.pt"})
# --8<-- [end:flow]
