"""GRPO on a tiny Hugging Face Qwen2 from its supervised warm-up (examples/qwen2_sft.py): prompts
from a jsonl file with their answers, the model's chat template applied, EOS from its tokenizer,
16 prompts x 8 samples a step, rewarded 1 when the response text is exactly the answer. The
mean reward rises from about 0.15:

    python examples/qwen2_build.py models/qwen2-tiny
    flowkit run examples/qwen2_sft.py --steps 600 --save-weights checkpoints
    flowkit run examples/qwen2_grpo.py --steps 40 --metrics qwen2-grpo-metrics.jsonl \
        --save-weights out

`--save-weights out` writes the trained actor as a Hugging Face folder, out/actor, that
`AutoModelForCausalLM.from_pretrained` loads.

The actor trains as two data-parallel replicas, one microbatch of 64 samples each, rather than
two pipeline stages: at 142k parameters each stage's ops cost well over half the whole model's,
and a pipeline adds hops and a bubble; the replicas' step is 0.76x the stages' (`flowkit bench
trl --pipeline`, docs/performance.md). A model too large for one executor takes `stages=`.
The reference's log-probs for the KL term come from the actor's own forward, one batched
forward of each microbatch (`reference_in_forward`), rather than a scoring op per batch of
finished samples: 0.81x the step at this size (docs/rl.md).
"""

import attrs

from dataflows.datasets import dataset_prompts
from dataflows.grpo import grpo_flow
from dataflows.recipes import dapo_flow, dr_grpo_flow, gspo_flow
from dataflows.rewards import exact_match_reward
from flowkit.dsl import Model

WARM = "checkpoints/actor"  # what the warm-up's --save-weights wrote

actor = Model(name="actor", build="hf", config={"path": WARM}, replicas=2, tags=("train",))
TASK = dict(model=actor, prompts=16, n=8, microbatches=2, schedule="1f1b", max_new_tokens=4,
            lr=5e-4, prompt_source=dataset_prompts,
            source_config={"path": "examples/data/arithmetic.jsonl", "tokenizer": WARM},
            reward=exact_match_reward)
flow = grpo_flow(kl_coef=0.001, reference_in_forward=True, **TASK)

# the recipes (dataflows/recipes.py): `flowkit run examples/qwen2_grpo.py:dapo`, ...
dapo = dapo_flow(**TASK)
dr_grpo = dr_grpo_flow(**TASK)
gspo = gspo_flow(**TASK)

# LoRA through peft (`:lora`): rank-8 adapters on the attention and MLP projections train, sync
# and save; `--save-weights out` writes out/actor as a peft adapter folder, which
# `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(WARM), "out/actor")` loads
lora = grpo_flow(kl_coef=0.001, **{**TASK, "lr": 5e-3, "model": attrs.evolve(actor, lora={
    "r": 8, "alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"]})})
