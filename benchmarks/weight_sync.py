"""Weight sync bench: a GRPO run whose weights reach the generator by broadcast (a gloo process
group on CPUs, NCCL across GPUs) against the same run through the host (the data plane).

Method: GRPO on digit sorting (fresh weights) with a GPT of width `n_embd` and `n_layer` layers
in 2 stages on torch executor processes (2 training, 1 rollout), 16 prompts x 8 samples a step;
the two sides go `steps` steps each, alternating, `rounds` runs each, every run a `flowkit.Run`
on the same executors; steps/s from the end of the first step to the end of the last, medians,
and the bytes each step's sync moves over the data plane (`MODEL/sync_bytes`). [Note: weight
sync paths in flowkit/runner/weight_sync.py]
"""

from __future__ import annotations

import statistics
import time

__all__ = ["run_weight_sync_bench"]

SIDES = ("host", "broadcast")


def run_weight_sync_bench(*, steps: int = 6, rounds: int = 2, n_embd: int = 256,
                          n_layer: int = 4) -> dict:
    from benchmarks.runs import bench_run
    from dataflows.grpo import grpo_flow
    from dataflows.models import GPT_BUILD
    from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward
    from flowkit.dsl import Model
    from flowkit.runtime import Controller, LocalExecutors

    if steps < 2:
        raise ValueError(f"the bench times the steps after the first: needs >= 2, got {steps}")
    gpt = {**SORT_GPT, "n_embd": n_embd, "n_layer": n_layer, "n_head": 4}
    flow = grpo_flow(
        model=Model(name="actor", build=GPT_BUILD, config=gpt, stages=2, tags=("train",)),
        prompts=16, n=8, microbatches=4, schedule="1f1b", max_new_tokens=SORT_RESPONSE_TOKENS,
        kl_coef=0.001, lr=3e-4, prompt_source=sort_prompts, reward=sort_reward,
        source_config={"digits": 3})
    tags = [("train",), ("train",), ("rollout",)]
    speeds: dict[str, list[float]] = {side: [] for side in SIDES}
    synced: dict[str, float] = {}
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="torch", tags=tags):
        for _ in range(rounds):
            for side in SIDES:
                ends, sent = [], []
                with bench_run(flow, controller=ctl, steps=steps, executors="torch",
                               weight_sync=side) as run:
                    for report in run.steps():
                        ends.append(time.perf_counter())
                        sent.append(report.metrics["actor/sync_bytes"])
                speeds[side].append((steps - 1) / (ends[-1] - ends[0]))
                synced[side] = statistics.median(sent)
    host, broadcast = (statistics.median(speeds[side]) for side in SIDES)
    weights = _weight_bytes(gpt)
    return {"host": {"steps_per_s": host, "sync_bytes": synced["host"]},
            "broadcast": {"steps_per_s": broadcast, "sync_bytes": synced["broadcast"]},
            "broadcast_over_host": {"steps_per_s": broadcast / host,
                                    "sync_bytes": synced["broadcast"] / synced["host"]},
            "model_bytes": weights, "steps": steps, "rounds": rounds, "gpt": gpt,
            "method": "median steps/s over steps 2..N of GRPO on sorting, torch executors "
                      "(2 train, 1 rollout), --weight-sync broadcast against host, "
                      "alternating on the same executors"}


def _weight_bytes(gpt: dict) -> int:
    from dataflows.models import GPT_BUILD
    from executors.optable import OpContext
    from executors.torch.models.built import held_model
    from flowkit.dsl import Model
    from flowkit.runner.training_tasks import model_spec

    spec = model_spec(Model(name="actor", build=GPT_BUILD, config=gpt), 1)
    held = held_model(OpContext(name="count", device="cpu", tags=()), spec)
    return sum(p.numel() * p.element_size() for p in held.parts[0].parameters())
