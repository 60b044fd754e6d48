"""A flow with the mistakes a new user makes, to see how flowkit reports them all at once:
`flowkit check examples/broken_flow.py` exits 1 and lists each one with its fix."""

from dataflows.model_ops import Backprop, Generate, OptimizerStep
from dataflows.rl.ops import answer_reward, arithmetic_prompts, grpo_advantages
from flowkit.dsl import Flow, Model

actor = Model(name="actor", build="executors.torch.models.gpt:GPT", stages=2)

with Flow("broken") as flow:
    prompts = arithmetic_prompts(count=8)
    rollouts = Generate(actor)(prompts, n=4, temprature=0.7)  # misspelt config
    scored = answer_reward(prompts)  # wants rollouts, gets prompts
    experiences = grpo_advantages(scored)  # groups need group_by(scored, key=..., size=...)
    stats = Backprop("critic")(experiences)  # no model named critic
    OptimizerStep(actor)(stats)  # a Batch input fed by a Stream: needs collect(stats)
