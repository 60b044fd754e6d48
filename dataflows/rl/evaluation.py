"""Evaluation during training: a flow's held-out prompts, sampled with the newest weights on the
rollout executors between steps (`flowkit run --eval-every K`), scored by the flow's reward.

An RL flow with `eval_source` set gets `flow.evaluation`, a flow of its own: the same prompt
op with its own count and settings (the same prompts every time it runs: the runner runs it as
its step 0), Generate on the actor without a weights input (the rollout executors hold the
weights the last optimizer step synced), the flow's reward, and `eval_metrics` over the whole
set: `eval/mean_reward`, `eval/pass@1` and, for n samples a prompt, `eval/pass@n` and
`eval/mean@n`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from dataflows.model_ops import Generate
from dataflows.rl.config import RLConfig
from flowkit.dsl import Batch, Flow, Metrics, Model, collect, op
from flowkit.ops.records import Scored

__all__ = ["attach_evaluation", "eval_metrics", "pass_at_k"]


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of the chance that at least one of k samples out of n, `correct`
    of them right, is right: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating large
    language models trained on code")."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, "
                         f"correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


@op
def eval_metrics(scored: Batch[Scored], *, pass_reward: float = 1.0) -> Metrics:
    """Over every prompt of the evaluation set: the mean reward, pass@1, and with n > 1
    samples a prompt pass@n (some sample of the prompt is right) and mean@n (the mean over
    prompts of their samples' mean reward). A sample is right when its reward is at least
    `pass_reward`."""
    groups: dict[int, list[float]] = defaultdict(list)
    for s in scored:
        groups[s.prompt_id].append(s.reward)
    if not groups:
        return Metrics({})
    n = min(len(rewards) for rewards in groups.values())
    right = [sum(r >= pass_reward for r in rewards) for rewards in groups.values()]
    sizes = [len(rewards) for rewards in groups.values()]
    metrics = {"eval/mean_reward": statistics.fmean(r for rs in groups.values() for r in rs),
               "eval/prompts": len(groups),
               "eval/pass@1": statistics.fmean(pass_at_k(size, c, 1)
                                               for size, c in zip(sizes, right))}
    if n > 1:
        metrics[f"eval/pass@{n}"] = statistics.fmean(pass_at_k(size, c, n)
                                                     for size, c in zip(sizes, right))
        metrics[f"eval/mean@{n}"] = statistics.fmean(statistics.fmean(rs)
                                                     for rs in groups.values())
    return Metrics(metrics)


def attach_evaluation(flow: Flow, actor: Model, config: RLConfig) -> Flow:
    """`flow` with its evaluation flow, when `config.eval_source` names one."""
    source = config.eval_source
    if source is None:
        return flow
    if not config.eval_prompts >= 1 or not config.eval_n >= 1:
        raise ValueError(f"eval_prompts={config.eval_prompts!r}, eval_n={config.eval_n!r}: the "
                         "evaluation samples eval_n responses to each of eval_prompts "
                         "prompts, both whole numbers >= 1")
    sampling = {**config.sampling.as_config(), "n": config.eval_n,
                "temperature": config.eval_temperature, "take": None,
                **config.agent.as_config()}
    with Flow(f"{flow.name}-eval", description="held-out prompts sampled with the newest "
              "weights between steps (flowkit run --eval-every)") as evaluation:
        prompts = source(count=config.eval_prompts, **dict(config.eval_source_config or {}))
        rollouts = Generate(actor, tags=("rollout",))(prompts, **sampling)
        eval_metrics(collect(config.reward(rollouts)), pass_reward=config.eval_pass_reward)
    flow.evaluation = evaluation
    return flow
