"""Inference benchmark: reference log-probs of a step's rollouts on this CPU, at the CPU's 256
padded tokens a forward against the GPU's 4096 ([Note: batch-invariant forwards] in
executors/torch/rollout/infer.py), side by side in one run.

Method: a built-in GPT the size of the README's tiny Qwen2 (vocabulary 300, 2 layers, 64 wide,
float32, one thread); 128 rollouts of a GRPO step (prompts of 14 to 30 tokens, 4 response
tokens); the `logprobs` op scores them in the batches a run made of them on that example
(`ARRIVALS`: samples finish at different times, so a step's batched tasks are uneven), and all
at once. Each (budget, batching) is timed `repeats` times, alternating; figures are medians in
milliseconds, and `arrivals_256_over_4096` is the ratio of the two budgets on the arrivals.
The scores are the same at either budget within float32 rounding, and the same bits in any
batching at one budget (tests/torch/test_infer.py).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

__all__ = ["ARRIVALS", "run_infer_bench"]

ARRIVALS = (21, 21, 19, 30, 31, 3, 3)  # a step of the README Qwen2 example, 128 rollouts
GPT = {"vocab_size": 300, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}
BUDGETS = (256, 4096)


def run_infer_bench(*, repeats: int = 5, seed: int = 0) -> dict:
    """Median ms per (budget, batching) and the arrivals' ratio of the two budgets."""
    import torch

    from dataflows.models import GPT_BUILD
    from executors.optable import OpContext, OpTable
    from executors.torch.rollout import infer
    from flowkit.ops.records import Rollout

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = OpTable()
        infer.register(table)
        logprobs = table.get("logprobs")
        ctx = OpContext(name="bench", device="cpu", tags=())
        spec = {"model": "policy", "build": GPT_BUILD, "model_config": GPT, "dtype": "float32",
                "seed": seed}
        rng = random.Random(seed)
        rollouts = [Rollout(prompt_id=i, sample=0, prompt_tokens=_tokens(rng, rng.randint(14, 30)),
                            response_tokens=_tokens(rng, 4), logprobs=[0.0] * 4)
                    for i in range(sum(ARRIVALS))]
        batchings = {"arrivals": list(ARRIVALS), "all_at_once": [len(rollouts)]}
        times: dict[str, list[float]] = {f"{name}_{budget}": [] for name in batchings
                                         for budget in BUDGETS}
        logprobs(ctx, rollouts[:2], **spec)  # the model built and warm
        for _ in range(repeats):
            for name, sizes in batchings.items():
                for budget in BUDGETS:
                    times[f"{name}_{budget}"].append(
                        _timed(logprobs, ctx, rollouts, sizes, {**spec, "max_tokens": budget}))
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"rollouts": len(rollouts), "arrivals": list(ARRIVALS),
                           "repeats": repeats, "model": GPT}
    out.update({f"{key}_ms": statistics.median(values) * 1e3 for key, values in times.items()})
    out["arrivals_256_over_4096"] = out["arrivals_256_ms"] / out["arrivals_4096_ms"]
    out["all_at_once_256_over_4096"] = out["all_at_once_256_ms"] / out["all_at_once_4096_ms"]
    return out


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, GPT["vocab_size"]) for _ in range(count)]


def _timed(op: Any, ctx: Any, rollouts: list, sizes: list[int], config: dict) -> float:
    start, begin = time.perf_counter(), 0
    for size in sizes:
        op(ctx, rollouts[begin:begin + size], **config)
        begin += size
    return time.perf_counter() - start
