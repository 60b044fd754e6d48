"""GRPO on digit sorting, from the supervised warm-up's weights (examples/sort_sft.py): 16
prompts x 8 samples a step, exact-match reward, the actor in two pipeline stages, generation on
its own executor with the weights synced every step. Mean reward rises from about 0.2 to 0.9:

    flowkit run examples/sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/grpo_sort.py --steps 40 --metrics grpo.jsonl
"""

from dataflows.grpo import grpo_flow
from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward

flow = grpo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
                 max_new_tokens=SORT_RESPONSE_TOKENS, kl_coef=0.001, lr=3e-4,
                 gpt={**SORT_GPT, "checkpoint": "checkpoints/actor.pt"},
                 prompt_source=sort_prompts, reward=sort_reward, source_config={"digits": 3})

# The same step asynchronously: generation runs up to one weights version ahead of training,
# stale tokens weighted by the decoupled objective (`flowkit run examples/grpo_sort.py:async_`,
# or `flowkit run examples/grpo_sort.py --max-staleness 1`)
async_ = grpo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
                   max_new_tokens=SORT_RESPONSE_TOKENS, kl_coef=0.001, lr=3e-4,
                   gpt={**SORT_GPT, "checkpoint": "checkpoints/actor.pt"},
                   prompt_source=sort_prompts, reward=sort_reward, source_config={"digits": 3},
                   max_staleness=1)

# ... and with partial rollouts: 24 prompts generate, the first 16 groups to finish train, the
# rest carry over to the next step
partial = grpo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
                    max_new_tokens=SORT_RESPONSE_TOKENS, kl_coef=0.001, lr=3e-4,
                    gpt={**SORT_GPT, "checkpoint": "checkpoints/actor.pt"},
                    prompt_source=sort_prompts, reward=sort_reward,
                    source_config={"digits": 3}, max_staleness=1, oversample=1.5)
