"""GRPO with a tool, from the warm-up's weights (examples/calculator_sft.py): each sample
answers a product ("123*45="), calling the calculator (dataflows.tools:calculator, run by
dataflows.tools:ToolEnvironment on the rollout executor) or not; a turn without a call is the
final answer, reward 1 when it is the product. The model learns to call the tool:

    flowkit run examples/calculator_sft.py --steps 800 --save-weights checkpoints
    flowkit run examples/calculator_grpo.py --steps 40 --metrics calculator.jsonl
"""

from dataflows.envs import CALCULATOR_GPT, product_prompts
from dataflows.grpo import grpo_flow
from dataflows.rewards import environment_reward

flow = grpo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b", kl_coef=0.001,
                 max_new_tokens=20, lr=1e-3,
                 gpt={**CALCULATOR_GPT, "checkpoint": "checkpoints/actor.pt"},
                 prompt_source=product_prompts, reward=environment_reward,
                 environment="dataflows.tools:ToolEnvironment",
                 env_config={"tools": ["dataflows.tools:calculator"]}, max_turns=2,
                 eval_source=product_prompts, eval_prompts=64, eval_source_config={"seed": 1})
