"""PPO on digit sorting, from the supervised warm-up's weights (examples/sort_sft.py): 64 prompts
a step, a critic (the GPT with a value head) for GAE, whitened advantages (a barrier), actor
and critic each in two pipeline stages, both synced to the generating executor every step:

    flowkit run examples/sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/ppo_sort.py --steps 40 --metrics ppo.jsonl

`epochs` is the same with several optimizer steps a flow step, as verl's ppo_epochs=2 and
ppo_mini_batch_size=32 would take them: each step's 64 experiences trained twice, each time
shuffled and cut into 2 minibatches of 32 (4 microbatches each), one optimizer step apiece:

    flowkit run examples/ppo_sort.py:epochs --steps 40 --metrics ppo-epochs.jsonl
"""

from dataflows.ppo import ppo_flow
from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward


def _ppo(**rounds):
    return ppo_flow(prompts=64, n=1, stages=2, microbatches=4, schedule="1f1b",
                    max_new_tokens=SORT_RESPONSE_TOKENS, kl_coef=0.05, lr=3e-4, critic_lr=1e-3,
                    gpt={**SORT_GPT, "checkpoint": "checkpoints/actor.pt"},
                    prompt_source=sort_prompts, reward=sort_reward, source_config={"digits": 3},
                    **rounds)


flow = _ppo()
epochs = _ppo(ppo_epochs=2, minibatches=2)
