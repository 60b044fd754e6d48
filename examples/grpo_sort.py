"""GRPO on digit sorting, from the supervised warm-up's weights (examples/sort_sft.py): 16
prompts x 8 samples a step, exact-match reward, the actor in two pipeline stages, generation on
its own executor with the weights synced every step. Mean reward rises from about 0.2 to 0.9:

    flowkit run examples/sort_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/grpo_sort.py --steps 40 --metrics grpo.jsonl

`--eval-every 5` also samples 64 held-out prompts greedily every 5 steps (eval/pass@1).
"""

from dataflows.grpo import grpo_flow
from dataflows.models import GPT_BUILD
from dataflows.recipes import dapo_flow, dr_grpo_flow, gspo_flow
from dataflows.rl.adaptive import AdaptiveSampling
from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward
from flowkit.dsl import Model

TASK = dict(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
            max_new_tokens=SORT_RESPONSE_TOKENS, lr=3e-4,
            gpt={**SORT_GPT, "checkpoint": "checkpoints/actor.pt"},
            prompt_source=sort_prompts, reward=sort_reward, source_config={"digits": 3},
            # held-out prompts: another seed than the training prompts' (0)
            eval_source=sort_prompts, eval_prompts=64,
            eval_source_config={"digits": 3, "seed": 1})

flow = grpo_flow(kl_coef=0.001, **TASK)

# The same step asynchronously: generation runs up to one weights version ahead of training,
# stale tokens weighted by the decoupled objective (`flowkit run examples/grpo_sort.py:async_`,
# or `flowkit run examples/grpo_sort.py --max-staleness 1`)
async_ = grpo_flow(kl_coef=0.001, max_staleness=1, **TASK)

# ... and with partial rollouts: 24 prompts generate, the first 16 groups to finish train, the
# rest carry over to the next step
partial = grpo_flow(kl_coef=0.001, max_staleness=1, oversample=1.5, **TASK)

# The recipes people run now (dataflows/recipes.py), from the same warm-up, no KL term:
# `flowkit run examples/grpo_sort.py:dapo` (clip-higher, token-level loss, overlong penalty),
# `:dr_grpo` (no std division, sums over the budget) and `:gspo` (sequence-level ratio)
dapo = dapo_flow(**TASK)
# DAPO without its further sampling rounds (`:dapo_one_round`): a step short of groups that
# differ trains fewer
dapo_one_round = dapo_flow(filter_rounds=1, **TASK)
dr_grpo = dr_grpo_flow(**TASK)
gspo = gspo_flow(**TASK)

# DARS's second round (`:second_round`): 4 samples a prompt, and 4 more within the step for a
# prompt none of whose first 4 passed (docs/rl.md, "A second round for groups that agree")
second_round = grpo_flow(kl_coef=0.001, **{**TASK, "n": 4}, adaptive=AdaptiveSampling(
    n_min=4, n_max=4, second_round=4, second_round_when="fail"))

# The rollout correction (TIS) on, to read the sampler-vs-trainer mismatch it reports
# (update_actor/mismatch/kl): `:tis`, and `:tis_bf16` with bfloat16 weights (on a GPU)
tis = grpo_flow(kl_coef=0.001, rollout_is="token", **TASK)
tis_bf16 = grpo_flow(kl_coef=0.001, rollout_is="token",
                     **{**TASK, "gpt": {**TASK["gpt"], "dtype": "bfloat16"}})

# LoRA (`:lora`): only rank-8 adapters on every projection train, sync to the generator (their
# bytes are actor/sync_bytes) and save (checkpoints/actor.lora.pt with --save-weights); the
# reference is the warm-up's weights, as the adapters start as no change. Adapters take a
# larger learning rate than the whole model.
lora = grpo_flow(kl_coef=0.001, **{**TASK, "gpt": None, "lr": 3e-3}, model=Model(
    name="actor", build=GPT_BUILD, config=TASK["gpt"], stages=2, tags=("train",),
    lora={"r": 8, "alpha": 16, "target_modules": ["c_attn", "c_proj", "c_fc"]}))
