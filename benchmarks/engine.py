"""Rollout benchmark (a): the torch rollout engine against one decode call per prompt.

Both generate the same samples from the same model on this machine's CPU, in this process:
`per_prompt` is the path before the engine (a generate task per prompt, decoding that prompt's
n samples together, prompts one after another: executors/torch/rollout/generate.py `decode`); the
engine takes every prompt as a request and decodes all live sequences together
(executors/torch/rollout/engine.py). Every sample runs to max_new_tokens (no EOS), so both sides
make the same number of tokens, and tokens/s compare directly. Runs alternate, and the median of
each side is reported with their ratio.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["engine_figures"]

# the digit-sorting RL task's size: 16 prompts x 8 samples, 9-token prompts, 8 new tokens,
# its GPT (dataflows/rl/tasks.py SORT_GPT); then a longer-response case
SIZES = ({"prompts": 16, "n": 8, "prompt_len": 9, "max_new_tokens": 8},
         {"prompts": 32, "n": 8, "prompt_len": 9, "max_new_tokens": 20})
SORT_GPT = {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64}


def engine_figures(*, repeats: int = 5) -> dict[str, Any]:
    import torch

    from executors.torch.models.gpt import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(**SORT_GPT).eval()
    figures = {}
    for size in SIZES:
        name = f"{size['prompts']}x{size['n']}_{size['max_new_tokens']}tok"
        figures[name] = _compare(model, size, repeats)
    return {"rollout_engine": figures}


def _compare(model: Any, size: dict, repeats: int) -> dict[str, Any]:
    prompts = _prompts(size["prompts"], size["prompt_len"])
    tokens = size["prompts"] * size["n"] * size["max_new_tokens"]
    times: dict[str, list[float]] = {"per_prompt": [], "engine": []}
    for _ in range(repeats):
        for side, run in (("per_prompt", _per_prompt), ("engine", _engine)):
            started = time.perf_counter()
            made = run(model, prompts, size)
            times[side].append(time.perf_counter() - started)
            assert made == tokens, (side, made, tokens)  # the same work on both sides
    per_prompt = tokens / statistics.median(times["per_prompt"])
    engine = tokens / statistics.median(times["engine"])
    return {"tokens": tokens, "per_prompt_tokens_per_s": round(per_prompt),
            "engine_tokens_per_s": round(engine), "speedup": round(engine / per_prompt, 2)}


def _prompts(count: int, length: int) -> list:
    from flowkit.ops.records import Prompt

    return [Prompt(prompt_id=i, tokens=[(7 * i + j) % 100 + 20 for j in range(length)])
            for i in range(count)]


def _per_prompt(model: Any, prompts: list, size: dict) -> int:
    import torch

    from executors.torch.models.built import evaluating
    from executors.torch.rollout.generate import _Sampling, decode

    s = _Sampling(n=size["n"], max_new_tokens=size["max_new_tokens"], temperature=1.0,
                  top_p=1.0, eos=None, seed=0, max_batch=64)
    made = 0
    with evaluating(model):
        for prompt in prompts:  # one task per prompt, as the runner submitted them
            made += sum(len(r.response_tokens)
                        for r in decode(model, [prompt], s, torch.device("cpu")))
    return made


def _engine(model: Any, prompts: list, size: dict) -> int:
    from executors.torch.rollout.engine import Engine, Sampling, run_all_until_done

    engine = Engine(model, version=lambda: None, max_batch=256, token_budget=2048)
    backgrounds = {"engine": engine}
    sampling = Sampling(max_new_tokens=size["max_new_tokens"], temperature=1.0)
    requests = [engine.submit([prompt], sampling, size["n"]) for prompt in prompts]
    return sum(len(r.response_tokens) for rollouts in run_all_until_done(backgrounds, requests)
               for r in rollouts)
