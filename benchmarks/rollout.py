"""Rollout benchmark: how close a step's generation comes to its lower bound on the simulator's
rollout engines [Note: simulated rollout engine in executors/sim/engine.py], with length-aware
dispatch [Note: length-aware dispatch in flowkit/runner/balance.py] against the dispatcher's
count-based choice, on the same long-tailed samples; and how soon the first sample reaches the
op downstream of generation.

The bound of a step: its longest sample must decode for as many iterations as it has tokens,
each costing t(b) = token + token_per_seq * b at the batch of the step then (the samples
still decoding, spread evenly over the executors, at most max_batch each: as if every sample
had started at once, with no prefill); and the executors must get through every token at
max_batch sequences an iteration at best (plus every prompt's prefill). The larger of the two.

Parts: "sim" (above), and "torch": the torch rollout engine against one decode call per
prompt on this CPU, tokens/s on the same samples (benchmarks/engine.py).

Each dispatch's run is a `flowkit.Run` (benchmarks/runs.py), read through its `run.runner`.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from flowkit.dsl import Flow, Model, Stream, op
from flowkit.ops.records import Prompt, Rollout

__all__ = ["RolloutSetup", "lower_bound_s", "run_rollout_bench"]


@attrs.frozen(kw_only=True)
class RolloutSetup:
    prompts: int = 64
    n: int = 8
    max_new_tokens: int = 1024
    prompt_tokens: int = 512  # prompts of a quarter of this to this many tokens: prefill
    length_sigma: float = 1.0  # log-normal lengths, median max_new_tokens / 8: a long tail
    prompt_sigma: float = 0.7  # prompts differ: a length predictor has something to learn
    executors: int = 2  # rollout executors, one engine each
    steps: int = 4  # the first has no length history; the figures are over the rest
    # the simulator's engine (SimCosts): seconds, and counts
    token: float = 0.0005
    token_per_seq: float = 0.000002
    prefill_token: float = 0.0000025
    token_budget: int = 2048
    max_batch: int = 256


def run_rollout_bench(setup: RolloutSetup | None = None, *,
                      parts: Sequence[str] = ("sim", "torch")) -> dict:
    """The figures of each part, by name, with the setup."""
    setup = setup or RolloutSetup()
    figures: dict[str, Any] = {"setup": attrs.asdict(setup)}
    for part in parts:
        if part not in _PARTS:
            raise ValueError(f"unknown rollout bench part {part!r}; parts: {', '.join(_PARTS)}")
        figures[part] = _PARTS[part](setup)
    return figures


# -- part (b): the simulator ---------------------------------------------------------------------
def _simulated(setup: RolloutSetup) -> dict:
    """Per dispatch, medians over the steps after the first (which has no length history)."""
    return {dispatch: _medians(_simulated_steps(setup, balance=dispatch == "length_aware")[1:])
            for dispatch in ("length_aware", "count_based")}


def _simulated_steps(setup: RolloutSetup, *, balance: bool) -> list[dict]:
    from benchmarks.runs import bench_run
    from flowkit.planner.simcosts import SimCosts

    costs = SimCosts(token=setup.token, token_per_seq=setup.token_per_seq,
                     prefill_token=setup.prefill_token, token_budget=setup.token_budget,
                     max_batch=setup.max_batch, length_sigma=setup.length_sigma,
                     prompt_sigma=setup.prompt_sigma)
    tags = [("rollout",)] * setup.executors
    figures = []
    with bench_run(_flow(setup), steps=setup.steps, executors="sim", sim_costs=costs,
                   num_executors=setup.executors, tags=tags, balance=balance) as run:
        for report in run.steps():  # the runner's state of the step just ended
            figures.append(_step_figures(run.runner, report.metrics, setup, costs))
    return figures


def _step_figures(runner: Any, metrics: dict, setup: RolloutSetup, costs: Any) -> dict:
    generate, downstream = runner.states["generate"], runner.states["response_length"]
    makespan = generate.last_end - generate.first_start
    lengths = [int(ref.result(timeout=60))
               for ref in runner.previous[("response_length", "out")].ordered()]
    prompts = [len(p.tokens) for p in long_prompts.fn(count=setup.prompts,
                                                       tokens=setup.prompt_tokens)]
    bound = lower_bound_s(lengths, prompts, executors=setup.executors, costs=costs)
    first = downstream.first_start - generate.first_start
    return {"makespan_s": makespan, "lower_bound_s": bound, "makespan_over_bound": makespan / bound,
            "first_downstream_s": first, "first_downstream_over_makespan": first / makespan,
            "longest": max(lengths), "samples": len(lengths),
            "length_rank_corr": metrics.get("generate/length_rank_corr"),
            "work_imbalance": metrics.get("generate/work_imbalance")}


def lower_bound_s(lengths: Sequence[int], prompt_tokens: Sequence[int], *, executors: int,
                  costs: Any) -> float:
    """A step's generation bound (the module's docstring) for samples of `lengths`."""
    longest, alive = max(lengths), sorted(lengths)
    ideal, gone = 0.0, 0
    for i in range(longest):  # iteration i: the samples longer than i still decode
        while alive[gone] <= i:
            gone += 1
        per_executor = min(costs.max_batch, math.ceil((len(alive) - gone) / executors))
        ideal += costs.iteration_s(per_executor)
    tokens = sum(lengths) / executors
    throughput = tokens * (costs.token / costs.max_batch + costs.token_per_seq) + (
        sum(prompt_tokens) * costs.prefill_token / executors)
    return max(ideal, throughput)


def _medians(steps: list[dict]) -> dict:
    return {key: statistics.median(values) if (values := [s[key] for s in steps
                                                          if s[key] is not None]) else None
            for key in steps[0]}


# -- the flow ----------------------------------------------------------------------------------
@op
def long_prompts(*, count: int = 64, tokens: int = 512, seed: int = 0) -> Stream[Prompt]:
    """`count` prompts of tokens // 4 to `tokens` tokens, the same ones (and ids) each step."""
    rng = random.Random(seed)
    for prompt_id in range(count):
        length = rng.randint(max(1, tokens // 4), max(1, tokens))
        yield Prompt(prompt_id=prompt_id, tokens=[rng.randrange(32, 127) for _ in range(length)])


@op
def response_length(rollout: Rollout) -> float:
    """The op downstream of generation: it runs on each sample as soon as it is out."""
    return float(len(rollout.response_tokens))


def _flow(setup: RolloutSetup) -> Flow:
    from dataflows.model_ops import Generate

    model = Model(name="policy", build="executors.torch.models.gpt:GPT", tags=("rollout",))
    with Flow("rollout", description=__doc__) as flow:
        prompts = long_prompts(count=setup.prompts, tokens=setup.prompt_tokens)
        rollouts = Generate(model)(prompts, n=setup.n, max_new_tokens=setup.max_new_tokens)
        response_length(rollouts)
    return flow


def _torch(setup: RolloutSetup) -> dict:
    """Its own sizes (the sorting task's): the setup is the simulator's."""
    from benchmarks.engine import engine_figures

    return engine_figures()


_PARTS: dict[str, Callable[[RolloutSetup], dict]] = {"sim": _simulated, "torch": _torch}
