"""REINFORCE++ on digit sorting, from the supervised warm-up's weights (examples/sort_sft.py): 64
prompts a step, no critic: the KL penalty in the token rewards, returns whitened over the
batch (a barrier), the actor in two pipeline stages, generation on its own executor with the
weights synced every step:

    flowkit run examples/sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/reinforce_pp_sort.py --steps 40 --metrics reinforce_pp.jsonl
"""

from dataflows.reinforce_pp import reinforce_pp_flow
from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward

flow = reinforce_pp_flow(prompts=64, n=1, stages=2, microbatches=4, schedule="1f1b",
                         max_new_tokens=SORT_RESPONSE_TOKENS, kl_coef=0.001, lr=3e-4,
                         gpt={**SORT_GPT, "checkpoint": "checkpoints/actor.pt"},
                         prompt_source=sort_prompts, reward=sort_reward,
                         source_config={"digits": 3})
