"""GRPO on digit sorting with a tiny float64 GPT from fresh weights: the actor in 2 stages,
generation on its own executor: small enough for a resume test."""

from dataflows.grpo import grpo_flow
from dataflows.rl.adaptive import AdaptiveSampling
from dataflows.rl.tasks import sort_prompts, sort_reward
from tests.torch.rl_ops import even_token_reward, late_sample_reward

TINY_GPT = {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16,
            "dtype": "float64"}

flow = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b", max_new_tokens=6,
                 kl_coef=0.001, lr=1e-2, gpt=TINY_GPT, prompt_source=sort_prompts,
                 reward=sort_reward, source_config={"digits": 3})
# `:reference_in_forward`: the reference's log-probs in the actor's last F [Note: reference in
# the F in executors/torch/train/rows.py], the reference held there and checkpointed with it
reference_in_forward = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b",
                                 max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                                 prompt_source=sort_prompts, reward=sort_reward,
                                 source_config={"digits": 3}, reference_in_forward=True)

# Adaptive sampling [Note: adaptive sampling in dataflows/rl/adaptive.py]: `:adaptive_at_n`
# gives every prompt the flow's n (the fixed flow's samples and update); `:adaptive` spreads
# a step's 16 samples by each prompt's pass rate (half its tokens even passes), the prompts
# coming back from a pool of 6 so that they have a history
adaptive_at_n = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b",
                          max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                          prompt_source=sort_prompts, reward=sort_reward,
                          source_config={"digits": 3},
                          adaptive=AdaptiveSampling(n_min=4, n_max=4))
adaptive = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b",
                     max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                     prompt_source=sort_prompts, reward=even_token_reward,
                     source_config={"digits": 3, "pool": 6},
                     adaptive=AdaptiveSampling(n_min=2, n_max=8, pass_reward=0.5))
# `:adaptive_partial`: the same with partial rollouts (--async): 6 prompts start, 4 train a step
adaptive_partial = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b",
                             max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                             prompt_source=sort_prompts, reward=even_token_reward,
                             source_config={"digits": 3, "pool": 6}, oversample=1.5,
                             adaptive=AdaptiveSampling(n_min=2, n_max=8, pass_reward=0.5))

# `:second_round` [Note: second rounds in flowkit/runner/second_round.py]: 4 first samples a
# prompt always agree, and a second round of 4 makes an even prompt's group differ
second_round = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b",
                         max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                         prompt_source=sort_prompts, reward=late_sample_reward,
                         source_config={"digits": 3, "pool": 6},
                         adaptive=AdaptiveSampling(n_min=4, n_max=4, second_round=4))

# Tree rollouts [Note: tree rollouts in executors/torch/rollout/branching.py]: `:tree` grows
# each prompt's one root into 4 leaves (2 branches at depths 2 and 4), as many samples as the
# flow's n = 4; `:tree_unbranched` names a depth but one branch: the plain flow's samples
tree = grpo_flow(prompts=4, n=1, stages=2, microbatches=2, schedule="1f1b", max_new_tokens=6,
                 kl_coef=0.001, lr=1e-2, gpt=TINY_GPT, prompt_source=sort_prompts,
                 reward=sort_reward, source_config={"digits": 3}, branch_at=(2, 4), branches=2)
# `:tree_partial`: the trees with partial rollouts (--async): 6 prompts start, 4 trees train a
# step, the rest carried over and grown on in the next; a stale one dropped whole
tree_partial = grpo_flow(prompts=4, n=1, stages=2, microbatches=2, schedule="1f1b",
                         max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                         prompt_source=sort_prompts, reward=sort_reward,
                         source_config={"digits": 3}, branch_at=(2, 4), branches=2,
                         oversample=1.5, stale_segments="drop")
# `:tree_entropy` forks where the model is unsure [Note: entropy branching in
# executors/torch/rollout/branching.py]; at 0 nats every token is, and it grows `:tree`'s trees
tree_entropy = grpo_flow(prompts=4, n=1, stages=2, microbatches=2, schedule="1f1b",
                         max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                         prompt_source=sort_prompts, reward=sort_reward,
                         source_config={"digits": 3}, branch_at=(2, 4), branches=2,
                         branch_entropy=0.0)
# Adaptive sampling of trees: n counts a prompt's roots. `:tree_adaptive_at_n` gives every
# prompt the flow's one root (`:tree`'s trees); `:tree_adaptive` spreads 8 roots a step over 4
# prompts of a pool of 6 by pass rate, each root growing up to 4 leaves
tree_adaptive_at_n = grpo_flow(prompts=4, n=1, stages=2, microbatches=2, schedule="1f1b",
                               max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                               prompt_source=sort_prompts, reward=sort_reward,
                               source_config={"digits": 3}, branch_at=(2, 4), branches=2,
                               adaptive=AdaptiveSampling(n_min=1, n_max=1))
tree_adaptive = grpo_flow(prompts=4, n=2, stages=2, microbatches=2, schedule="1f1b",
                          max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                          prompt_source=sort_prompts, reward=even_token_reward,
                          source_config={"digits": 3, "pool": 6}, branch_at=(2, 4), branches=2,
                          adaptive=AdaptiveSampling(n_min=1, n_max=4, pass_reward=0.5))
# `:tree_adaptive_partial`: those trees with partial rollouts (--async): 6 prompts start a step,
# 4 trees train, the rest carried over and grown on, a stale one dropped whole
tree_adaptive_partial = grpo_flow(prompts=4, n=2, stages=2, microbatches=2, schedule="1f1b",
                                  max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                                  prompt_source=sort_prompts, reward=even_token_reward,
                                  source_config={"digits": 3, "pool": 6}, branch_at=(2, 4),
                                  branches=2, oversample=1.5, stale_segments="drop",
                                  adaptive=AdaptiveSampling(n_min=1, n_max=4, pass_reward=0.5))
tree_unbranched = grpo_flow(prompts=4, n=4, stages=2, microbatches=2, schedule="1f1b",
                            max_new_tokens=6, kl_coef=0.001, lr=1e-2, gpt=TINY_GPT,
                            prompt_source=sort_prompts, reward=sort_reward,
                            source_config={"digits": 3}, branch_at=(3,), branches=1)
