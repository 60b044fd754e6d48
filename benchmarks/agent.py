"""Multi-turn rollout benchmark [Note: multi-turn rollouts in flowkit/ops/environments.py]: the
rollout engine generating trajectories whose environment takes `latency` seconds a step (a
tool, a sandboxed program), three ways side by side in one run:

- `overlapped`: the engine's own way, environment steps in threads (8) while the other
  trajectories decode, each waiting one keeping its cache row (keep_cache);
- `released`: the same, the rows given up while waiting and the prefixes prefilled again;
- `one_call_at_a_time`: the baseline, environment steps one after another (one thread), so a
  trajectory's wait adds to every other's.

Method: the built-in GPT (vocabulary 128, 2 layers, 64 wide, float32, one thread), `samples`
trajectories of the guessing game's shape (prompt of 10 bytes, turns of 4 sampled tokens, a
7-byte answer, `turns` turns each), in one request of the engine stepped in this process.
Each way runs `repeats` times, alternating; figures are medians.
"""

from __future__ import annotations

import statistics
import time

from flowkit.ops import Environment, EnvStep

__all__ = ["SlowEnvironment", "run_agent_bench"]

GPT = {"vocab_size": 128, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}
WAYS = {"overlapped": (True, 8), "released": (False, 8), "one_call_at_a_time": (True, 1)}


class SlowEnvironment(Environment):
    """Answers "higher" after `latency` seconds, for `turns` turns."""

    def __init__(self, latency: float = 0.02, turns: int = 4) -> None:
        self.latency, self.turns, self.steps = float(latency), int(turns), 0

    def step(self, action: str) -> EnvStep:
        time.sleep(self.latency)
        self.steps += 1
        return EnvStep(observation="higher", reward=1.0, done=self.steps >= self.turns)


def run_agent_bench(*, samples: int = 32, turns: int = 4, latency: float = 0.02,
                    repeats: int = 3, seed: int = 0) -> dict:
    """Median seconds of each way, its prefill tokens, and the ratios to the engine's own."""
    import torch

    from dataflows.models import GPT_BUILD
    from executors.optable import OpContext
    from executors.torch.engine import Engine, Sampling, run_until_done
    from executors.torch.held import whole_model
    from executors.torch.turns import Agent, ByteTurns, EnvCalls
    from flowkit.ops.records import Prompt

    if repeats < 1 or samples < 1 or turns < 1 or latency < 0:
        raise ValueError(f"samples, turns and repeats must be >= 1 and latency >= 0, got "
                         f"{samples}, {turns}, {repeats} and {latency}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = OpContext(name="bench", device="cpu", tags=())
        model = whole_model(ctx, {"model": "policy", "build": GPT_BUILD, "model_config": GPT,
                                  "dtype": "float32", "seed": seed, "stages": 1}).eval()
        prompts = [Prompt(prompt_id=i, tokens=list(b"guess 1-8:")) for i in range(samples)]
        sampling = Sampling(max_new_tokens=4, temperature=1.0, eos=None, seed=seed)
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        prefill: dict[str, int] = {}
        for _ in range(repeats):
            for way, (keep_cache, env_threads) in WAYS.items():
                engine = Engine(model, version=lambda: None, max_batch=samples)
                engine.env_calls = EnvCalls(threads=env_threads)
                agent = Agent(make=lambda: SlowEnvironment(latency, turns), turns=ByteTurns(),
                              max_turns=turns, max_total_tokens=None, timeout_s=60.0,
                              keep_cache=keep_cache)
                start = time.perf_counter()
                done = run_until_done({"engine": engine},
                                      engine.submit(prompts, sampling, 1, agent=agent))
                seconds[way].append(time.perf_counter() - start)
                prefill[way] = engine.stats["prefill_tokens"]
                assert len(done) == samples and all(r.turns == turns for r in done)
    finally:
        torch.set_num_threads(threads)
    median = {way: statistics.median(times) for way, times in seconds.items()}
    return {"samples": samples, "turns": turns, "latency_s": latency, "repeats": repeats,
            **{f"{way}_s": median[way] for way in WAYS},
            **{f"{way}_prefill_tokens": prefill[way] for way in WAYS},
            "overlapped_over_one_call_at_a_time": median["overlapped"]
            / median["one_call_at_a_time"],
            "released_over_overlapped": median["released"] / median["overlapped"]}
