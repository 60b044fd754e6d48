"""Evaluation bench: what `--eval-every` costs a run, against the same run without it.

Method: GRPO on digit sorting (the examples' task and model, fresh weights) on torch executor
processes, 2 training and 1 rollout, 64 held-out prompts sampled greedily every `every` steps
[Note: evaluation during training in flowkit/runner/evaluation.py]. Each of the synchronous and
the asynchronous (staleness bound 1) run goes `steps` steps with the evaluation and without,
alternating, `rounds` runs each, every run a `flowkit.Run` on the same executors; steps/s from
the end of the first step to the end of the last, medians; `ratio` is with / without, so 1.0
means the evaluation cost nothing. A synchronous run waits for each evaluation; an asynchronous
one runs it alongside the next step.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["run_eval_bench"]


def run_eval_bench(*, steps: int = 20, rounds: int = 2, every: int = 2,
                   eval_prompts: int = 64) -> dict:
    from dataflows.grpo import grpo_flow
    from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward
    from flowkit.runtime import Controller, LocalExecutors

    if steps < 2:
        raise ValueError(f"the bench times the steps after the first: needs >= 2, got {steps}")
    flow = grpo_flow(prompts=16, n=8, stages=2, microbatches=4, schedule="1f1b",
                     max_new_tokens=SORT_RESPONSE_TOKENS, kl_coef=0.001, lr=3e-4,
                     gpt=SORT_GPT, prompt_source=sort_prompts, reward=sort_reward,
                     source_config={"digits": 3}, eval_source=sort_prompts,
                     eval_prompts=eval_prompts, eval_source_config={"digits": 3, "seed": 1})
    tags = [("train",), ("train",), ("rollout",)]
    figures: dict = {}
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="torch", tags=tags):
        for mode, staleness in (("sync", None), ("async", 1)):
            runs: dict[str, list[float]] = {"without": [], "with": []}
            for _ in range(rounds):
                for name in runs:
                    runs[name].append(_steps_per_s(ctl, flow, steps, staleness,
                                                   every if name == "with" else None))
            without, with_ = (statistics.median(runs[n]) for n in ("without", "with"))
            figures[mode] = {"steps_per_s_without": without, "steps_per_s_with": with_,
                             "ratio": with_ / without}
    return {**figures, "steps": steps, "rounds": rounds, "eval_every": every,
            "eval_prompts": eval_prompts,
            "method": "median steps/s over steps 2..N of GRPO on sorting, torch executors "
                      "(2 train, 1 rollout), --eval-every against none, alternating"}


def _steps_per_s(ctl: object, flow: object, steps: int, staleness: int | None,
                 every: int | None) -> float:
    from benchmarks.runs import bench_run

    ends = []
    with bench_run(flow, controller=ctl, steps=steps, executors="torch",
                   asynchronous=staleness is not None, max_staleness=staleness,
                   eval_every=every) as run:
        for _ in run.steps():
            ends.append(time.perf_counter())
    return (steps - 1) / (ends[-1] - ends[0])
