"""LoRA bench: a GRPO run training rank-r adapters against the same run training every weight.

Method: GRPO on digit sorting (the examples' task, fresh weights) with a larger GPT than the
examples' (`n_embd`, `n_layer`), on torch executor processes (2 training, 1 rollout), 16 prompts
x 8 samples a step. The full run and the LoRA run (adapters on every projection: c_attn, c_proj,
c_fc) go `steps` steps each, alternating, `rounds` runs each, every run a `flowkit.Run` on the
same executors; steps/s from the end of the first step to the end of the last, medians. Beside
them: the parameters each trains and the bytes each step's weight sync moves to the generator
(`MODEL/sync_bytes`, the exports as serialized). [Note: LoRA in flowkit/dsl/lora.py]
"""

from __future__ import annotations

import statistics
import time

__all__ = ["run_lora_bench"]

TARGETS = ["c_attn", "c_proj", "c_fc"]


def run_lora_bench(*, steps: int = 8, rounds: int = 2, rank: int = 8, n_embd: int = 256,
                   n_layer: int = 4) -> dict:
    from dataflows.grpo import grpo_flow
    from dataflows.models import GPT_BUILD
    from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward
    from flowkit.dsl import Model
    from flowkit.runtime import Controller, LocalExecutors

    if steps < 2:
        raise ValueError(f"the bench times the steps after the first: needs >= 2, got {steps}")
    gpt = {**SORT_GPT, "n_embd": n_embd, "n_layer": n_layer, "n_head": 4}
    lora = {"r": rank, "alpha": 2 * rank, "target_modules": TARGETS}
    flows = {side: grpo_flow(
        model=Model(name=side, build=GPT_BUILD, config=gpt, stages=2, tags=("train",),
                    lora=lora if side == "lora" else None),
        prompts=16, n=8, microbatches=4, schedule="1f1b", max_new_tokens=SORT_RESPONSE_TOKENS,
        kl_coef=0.001, lr=3e-3 if side == "lora" else 3e-4, prompt_source=sort_prompts,
        reward=sort_reward, source_config={"digits": 3}) for side in ("full", "lora")}
    tags = [("train",), ("train",), ("rollout",)]
    speeds: dict[str, list[float]] = {side: [] for side in flows}
    synced: dict[str, float] = {}
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="torch", tags=tags):
        for _ in range(rounds):
            for side, flow in flows.items():
                speed, synced[side] = _run(ctl, flow, steps, side)
                speeds[side].append(speed)
    full, adapted = (statistics.median(speeds[side]) for side in ("full", "lora"))
    trained = _trained_parameters(gpt, lora)
    return {"full": {"steps_per_s": full, "sync_bytes": synced["full"],
                     "trained_parameters": trained["full"]},
            "lora": {"steps_per_s": adapted, "sync_bytes": synced["lora"],
                     "trained_parameters": trained["lora"]},
            "lora_over_full": {"steps_per_s": adapted / full,
                               "sync_bytes": synced["lora"] / synced["full"],
                               "trained_parameters": trained["lora"] / trained["full"]},
            "steps": steps, "rounds": rounds, "rank": rank, "gpt": gpt,
            "method": "median steps/s over steps 2..N of GRPO on sorting, torch executors "
                      "(2 train, 1 rollout), LoRA on c_attn, c_proj, c_fc against every "
                      "weight, alternating on the same executors"}


def _run(ctl: object, flow: object, steps: int, model: str) -> tuple[float, float]:
    from benchmarks.runs import bench_run

    ends, synced = [], []
    with bench_run(flow, controller=ctl, steps=steps, executors="torch") as run:
        for report in run.steps():
            ends.append(time.perf_counter())
            synced.append(report.metrics[f"{model}/sync_bytes"])
    return (steps - 1) / (ends[-1] - ends[0]), statistics.median(synced)


def _trained_parameters(gpt: dict, lora: dict) -> dict[str, int]:
    """The parameters each side trains, counted on the model as the executors build it."""
    from dataflows.models import GPT_BUILD
    from executors.optable import OpContext
    from executors.torch.models.built import held_model
    from flowkit.dsl import Model
    from flowkit.runner.training_tasks import model_spec

    counts = {}
    for side, settings in (("full", None), ("lora", lora)):
        spec = model_spec(Model(name=side, build=GPT_BUILD, config=gpt, lora=settings), 1)
        held = held_model(OpContext(name="count", device="cpu", tags=()), spec)
        counts[side] = sum(p.numel() for p in held.parts[0].parameters() if p.requires_grad)
    return counts
