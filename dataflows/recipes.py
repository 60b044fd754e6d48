"""The GRPO recipes people run now, as settings of `grpo_flow` under their papers' names. Each
is a GroupRLConfig whose knobs are verl's (flowkit/ops/losses.py says each); a flow function
takes the same keyword shortcuts as grpo_flow, which override the recipe's:

    dapo_flow(prompts=16, max_new_tokens=64)                 # DAPO's settings
    dapo_flow(prompts=16, clip_ratio_high=0.3)               # ... with another clip-higher

DAPO (Yu et al. 2025): clip-higher (0.2 below, 0.28 above), the token-level loss, no KL term,
the dual clip at 10, the soft overlong penalty over the last fifth of the budget (their 4,096
of 20,480 tokens), and dynamic sampling: twice the prompts generate, the groups whose rewards
are all equal are dropped, and the step trains the first `prompts` of the others; where too few
differ, another round as large generates, up to 3 rounds (`filter_groups`, `filter_oversample`,
`filter_rounds`; a step still short trains fewer and says so).

Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): advantages without the
group std, each response's summed loss over the generation budget (not its own length), no KL.

GSPO (Zheng et al. 2025): the sequence-level importance ratio, clipped per response at 3e-4
below and 4e-4 above, averaged per response, no KL.

`multi_turn_grpo_flow`: GRPO whose samples are multi-turn trajectories, in an environment or
by an agent program ([Note: multi-turn rollouts] in flowkit/ops/environments.py), scored by the
environment's rewards unless another reward is given. Every RL flow takes those settings; this
one requires them, so a forgotten environment is an error rather than single responses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs

from dataflows.grpo import grpo_flow
from dataflows.rewards import environment_reward
from dataflows.rl.config import GroupRLConfig, PolicyLoss, RLConfig, shortcuts_of, with_shortcuts
from flowkit.dsl import Flow

__all__ = ["DAPO", "DR_GRPO", "GSPO", "dapo_flow", "dr_grpo_flow", "gspo_flow",
           "multi_turn_grpo_flow"]

DAPO = GroupRLConfig(kl_coef=0.0, filter_groups=True, filter_rounds=3,
                     policy=PolicyLoss(clip_ratio_low=0.2, clip_ratio_high=0.28,
                                       clip_ratio_c=10.0, loss_agg_mode="token-mean"))
DR_GRPO = GroupRLConfig(kl_coef=0.0, scale_rewards=False,
                        policy=PolicyLoss(loss_agg_mode="seq-mean-token-sum-norm"))
GSPO = GroupRLConfig(kl_coef=0.0, policy=PolicyLoss(policy_loss="gspo", clip_ratio_low=3e-4,
                                                    clip_ratio_high=4e-4))

# DAPO's overlong buffer is a fifth of the response budget (4,096 of 20,480 tokens)
_DAPO_BUFFER_SHARE = 5


def _dapo_buffer(config: RLConfig) -> RLConfig:
    if config.overlong_buffer:
        return config
    budget = config.sampling.max_new_tokens
    return attrs.evolve(config, overlong_buffer=max(1, budget // _DAPO_BUFFER_SHARE))


def _recipe(recipe: GroupRLConfig, name: str,
            finish: Callable[[RLConfig], RLConfig] = lambda config: config
            ) -> Callable[..., Flow]:
    """A flow function: grpo_flow from `recipe` with the shortcuts given, then `finish`."""
    shortcuts = shortcuts_of(GroupRLConfig)

    @functools.wraps(grpo_flow)
    def flow(config: GroupRLConfig | None = None, **keywords: Any) -> Flow:
        if config is not None:  # it would replace the recipe's settings, not add to them
            raise TypeError(f"{name} takes the recipe's settings and keyword shortcuts over "
                            f"them, not a config record: give grpo_flow(config) instead, or "
                            f"{name}(prompts=..., ...)")
        given = {k: keywords.pop(k) for k in list(keywords) if k in shortcuts}
        return grpo_flow(finish(with_shortcuts(recipe, **given)), **keywords)

    flow.__name__ = flow.__qualname__ = name
    flow.__doc__ = f"grpo_flow with the {name.removesuffix('_flow')} recipe's settings " \
                   f"(dataflows/recipes.py); keyword shortcuts override them."
    return flow


dapo_flow = _recipe(DAPO, "dapo_flow", _dapo_buffer)
dr_grpo_flow = _recipe(DR_GRPO, "dr_grpo_flow")
gspo_flow = _recipe(GSPO, "gspo_flow")


def multi_turn_grpo_flow(config: RLConfig | None = None, **settings: Any) -> Flow:
    """grpo_flow (its config or keyword shortcuts, `model=` any Model) whose samples are
    trajectories: `environment` ("module:Class", with `env_config`) or `program` ("module:
    function", an agent written against the OpenAI API), `max_turns`, ...; `reward`
    defaults to environment_reward (the sum of the environment's step rewards, or what the
    program returned)."""
    agent = settings.get("agent") or (config.agent if config is not None else None)
    given = [settings.get("environment"), settings.get("program"),
             *((agent.environment, agent.program) if agent is not None else ())]
    if not any(given):
        raise ValueError("multi_turn_grpo_flow rolls out trajectories: give environment="
                         "'package.module:Class' (and env_config) or program='package.module:"
                         "function', e.g. environment='dataflows.envs:GuessNumber'")
    if config is None:
        settings.setdefault("reward", environment_reward)
        return grpo_flow(**settings)
    return grpo_flow(config, **settings)
