"""`flowkit bench train --packing`: tokens/s of packed rows against padded ones [Note: packed
rows in executors/torch/models/packing.py], the same model, data and schedule on the same torch
executors in one run. The data is RL-shaped: a prompt and a response of log-normal length
(median 64, sigma 1, at most the budget of 512) a sample, trained under PPO's clipped loss, so
the padded rows carry what a long-tailed batch pads; both runs' losses are reported, and equal."""

from __future__ import annotations

import math
import random
import statistics

import attrs

from flowkit.dsl import Stream, op
from flowkit.ops.records import Experience

__all__ = ["PackingSetup", "lognormal_experiences", "run_packing_bench"]


@attrs.frozen(kw_only=True)
class PackingSetup:
    stages: int = 2
    microbatches: int = 4
    batch_size: int = 64  # samples a step
    steps: int = 4  # per mode; the first (profiling, warm-up) is not counted
    median: int = 64  # response lengths: log-normal, this median, sigma, at most budget
    sigma: float = 1.0
    budget: int = 512
    prompt: int = 16
    schedule: str = "1f1b"
    gpt: dict = attrs.field(factory=lambda: {"vocab_size": 256, "block_size": 544,
                                             "n_layer": 4, "n_head": 4, "n_embd": 128})


@op
def lognormal_experiences(*, sequences: int = 64, median: int = 64, sigma: float = 1.0,
                          budget: int = 512, prompt: int = 16, vocab: int = 256, seed: int = 0,
                          step: int = 0) -> Stream[Experience]:
    """`sequences` samples a step: a prompt of `prompt` tokens, a response of a log-normal
    length (its `median`, `sigma`, at most `budget`), random tokens, advantages of +-1 and
    log-probs of a uniform sampler; the same ones for the same seed and step."""
    rng = random.Random(f"{seed}/{step}")
    for i in range(sequences):
        length = max(1, min(budget, round(rng.lognormvariate(math.log(median), sigma))))
        sign = 1.0 if i % 2 else -1.0
        yield Experience(prompt_id=step * sequences + i, sample=0,
                         prompt_tokens=[rng.randrange(vocab) for _ in range(prompt)],
                         response_tokens=[rng.randrange(vocab) for _ in range(length)],
                         logprobs=[-math.log(vocab)] * length, reward=sign,
                         advantages=[sign] * length)


def _flow(setup: PackingSetup, *, packing: bool):
    from dataflows.model_ops import Backprop, OptimizerStep
    from dataflows.models import GPT_BUILD
    from flowkit.dsl import Flow, Model, collect

    name = "packed" if packing else "padded"
    model = Model(name=name, build=GPT_BUILD, config=dict(setup.gpt), stages=setup.stages,
                  tags=("train",), packing=packing)
    with Flow(f"packing-bench-{name}") as flow:
        samples = lognormal_experiences(sequences=setup.batch_size, median=setup.median,
                                        sigma=setup.sigma, budget=setup.budget,
                                        prompt=setup.prompt, vocab=setup.gpt["vocab_size"])
        stats = Backprop(model)(samples, loss="ppo", schedule=setup.schedule,
                                microbatches=setup.microbatches)
        OptimizerStep(model)(collect(stats), lr=1e-4)
    return flow


def run_packing_bench(setup: PackingSetup | None = None) -> dict:
    """Padded then packed training of the same steps on the same executors: tokens/s (real
    tokens: prompts and responses, no padding), the losses of every step, and the ratio."""
    from benchmarks.runs import bench_run
    from flowkit.runtime import Controller, LocalExecutors

    setup = setup or PackingSetup()
    out: dict = {"setup": attrs.asdict(setup)}
    with Controller() as ctl, LocalExecutors(ctl, setup.stages, kind="torch", tags=("train",)):
        for mode in ("padded", "packed"):
            flow = _flow(setup, packing=mode == "packed")
            with bench_run(flow, controller=ctl, steps=setup.steps, executors="torch") as run:
                reports = list(run.steps())
            out[mode] = _figures(reports, setup)
    out["packed_over_padded_tokens_per_s"] = (out["packed"]["tokens_per_s"]
                                              / out["padded"]["tokens_per_s"])
    pairs = zip(out["packed"]["losses"], out["padded"]["losses"])
    out["max_loss_gap"] = max(abs(a - b) for a, b in pairs)
    return out


def _figures(reports: list, setup: PackingSetup) -> dict:
    timed = reports[1:]  # the first step profiles and warms up
    seconds = sum(r.elapsed_s for r in timed)
    tokens = sum(_tokens(setup, r.step) for r in timed)
    losses = [next(v for k, v in r.metrics.items() if k.endswith("/loss")) for r in reports]
    return {"step_s": statistics.median(r.elapsed_s for r in timed),
            "tokens_per_s": tokens / seconds, "losses": losses}


def _tokens(setup: PackingSetup, step: int) -> int:
    """A step's real tokens, prompts and responses, as the source made them."""
    samples = lognormal_experiences.fn(sequences=setup.batch_size, median=setup.median,
                                       sigma=setup.sigma, budget=setup.budget,
                                       prompt=setup.prompt, vocab=setup.gpt["vocab_size"],
                                       step=step)
    return sum(len(e.prompt_tokens) + len(e.response_tokens) for e in samples)
