"""RL step benchmark: a GRPO and a PPO step on simulator executors with long-tailed response
lengths, fused (sample-level: scoring, reference and value inference start per sample, GRPO
groups as their n samples are in, training microbatches as groups finish) against the same
flow run stage by stage with barriers (`--no-fuse`), on the same samples, side by side.

Generation runs on `rollout` executors and training on `train` ones, as in a disaggregated RL
system; a sample's response length is log-normal (most short, a few at the token budget),
so a step's generation ends with a long tail during which, fused, training already runs.
Then the real thing at toy scale: the digit-sorting GRPO step on torch executors on this CPU.
"""

from __future__ import annotations

import statistics
from typing import Any

import attrs

__all__ = ["RLSetup", "run_rl_bench"]


@attrs.frozen
class RLSetup:
    prompts: int = 32
    n: int = 8  # samples per prompt (GRPO); PPO samples each prompt n times too
    max_new_tokens: int = 512
    length_sigma: float = 1.0  # log-normal response lengths, median max_new_tokens / 8
    rollout_executors: int = 8  # 4 prompts each: most of the batch decodes at once, as on GPUs
    train_executors: int = 2  # = pipeline stages
    microbatches: int = 16
    schedule: str = "1f1b"
    steps: int = 4  # the first is a barrier in both modes (it learns the batch size)
    # seconds: a decode iteration's fixed cost, a token of inference, one F / B / W of one
    # microbatch on one stage. Every executor's 32 sequences decode together on its rollout
    # engine (executors/simengine.py), so a 2 ms iteration makes generation about half of the
    # step stage by stage: still short of the 70-90 % the RL systems report, which favours
    # the barrier run (at 0.5 ms, a quarter of the step)
    token: float = 0.002
    infer_token: float = 0.00002
    F: float = 0.012
    B: float = 0.012
    W: float = 0.008
    optimizer_step: float = 0.01


def run_rl_bench(setup: RLSetup | None = None, *, torch_steps: int = 6) -> dict:
    """Per algorithm: the median step time fused and with barriers, and their ratio; then the
    same for the GRPO digit-sorting example's step on torch executors on this machine's CPU
    (`torch_steps` steps each, 0 to skip)."""
    from flowkit.planner.simcosts import SimCosts

    setup = setup or RLSetup()
    costs = SimCosts(F=setup.F, B=setup.B, W=setup.W, optimizer_step=setup.optimizer_step,
                     token=setup.token, infer_token=setup.infer_token,
                     length_sigma=setup.length_sigma)
    tags = [("rollout",)] * setup.rollout_executors + [("train",)] * setup.train_executors
    figures: dict[str, Any] = {"setup": attrs.asdict(setup)}
    for algo in ("grpo", "ppo"):
        times = {fuse: _step_time(_flow(setup, algo), "sim", tags, setup.steps, costs, fuse)
                 for fuse in (True, False)}
        figures[algo] = _compared(times)
    if torch_steps:
        tags = [("rollout",), ("train",), ("train",)]
        times = {fuse: _step_time(_sorting_flow(), "torch", tags, torch_steps, None, fuse)
                 for fuse in (True, False)}
        figures["torch_cpu_grpo"] = {**_compared(times), "executors": len(tags),
                                     "flow": "examples/grpo_sort.py from random weights"}
    return figures


def _compared(times: dict[bool, tuple[float, float]]) -> dict:
    return {"fused_step_s": times[True][0], "barrier_step_s": times[False][0],
            "speedup": times[False][0] / times[True][0],
            "barrier_generation_share": times[False][1]}


def _step_time(flow: Any, kind: str, tags: list, steps: int, costs: Any,
               fuse: bool) -> tuple[float, float]:
    """Median seconds of the steps after the first (which profiles, warms up and, fused, learns
    the batch size), on fresh executors; and the median share of generation in them."""
    from flowkit.planner.lower import lower_flow
    from flowkit.runtime import Controller, LocalExecutors
    from flowkit.runtime.flowrun import FlowRunner

    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind=kind, tags=tags):
        runner = FlowRunner(ctl, lower_flow(flow), sim_costs=costs, fuse=fuse)
        reports = [runner.run_step(step) for step in range(steps)][1:]
    return (statistics.median(r.elapsed_s for r in reports),
            statistics.median(r.timing_s.get("generate", 0.0) / r.elapsed_s for r in reports))


def _sorting_flow() -> Any:
    from dataflows.grpo import grpo_flow
    from dataflows.rl.tasks import SORT_GPT, sort_prompts, sort_reward

    return grpo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
                     max_new_tokens=8, gpt=SORT_GPT, prompt_source=sort_prompts,
                     reward=sort_reward, source_config={"digits": 3})


def _flow(setup: RLSetup, algo: str) -> Any:
    train = dict(stages=setup.train_executors, schedule=setup.schedule,
                 microbatches=setup.microbatches, max_new_tokens=setup.max_new_tokens)
    if algo == "grpo":
        from dataflows.grpo import grpo_flow

        return grpo_flow(prompts=setup.prompts, n=setup.n, **train)
    from dataflows.ppo import ppo_flow

    return ppo_flow(prompts=setup.prompts, n=setup.n, **train)
