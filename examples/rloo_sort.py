"""RLOO on digit sorting, from the supervised warm-up's weights (examples/sort_sft.py): 16
prompts x 8 samples a step, exact-match reward with the KL penalty folded in, leave-one-out
advantages per prompt, the actor in two pipeline stages, generation on its own executor with
the weights synced every step:

    flowkit run examples/sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/rloo_sort.py --steps 40 --metrics rloo.jsonl
"""

from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward
from dataflows.rloo import rloo_flow

flow = rloo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
                 max_new_tokens=SORT_RESPONSE_TOKENS, kl_coef=0.001, lr=3e-4,
                 gpt={**SORT_GPT, "checkpoint": "checkpoints/actor.pt"},
                 prompt_source=sort_prompts, reward=sort_reward, source_config={"digits": 3})
