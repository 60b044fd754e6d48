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

`run_program_bench` (`flowkit bench agent --programs`) prices agent programs [Note: agent
programs in executors/torch/rollout/endpoint.py]: the same trajectories rolled out by an in-process
environment and by an agent program that says the same things through the endpoint (an HTTP
request a turn), once over bare http.client and once with the openai client, side by side, on
a tiny random Qwen2 with the example's chat template (examples/qwen2_build.py's tokenizer
code), environment steps taking no time: the differences are the endpoint's cost a turn and
the openai client's. It checks that every way samples the same tokens.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from flowkit.ops import Environment, EnvStep

__all__ = ["Higher", "SlowEnvironment", "higher_program", "run_agent_bench",
           "run_program_bench"]

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
    from executors.torch.models.built import whole_model
    from executors.torch.rollout.engine import Engine, Sampling, run_until_done
    from executors.torch.rollout.turns import Agent, ByteTurns, EnvCalls
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
                agent = Agent(make=lambda prompt, sample: SlowEnvironment(latency, turns),
                              turns=ByteTurns(),
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


class Higher(Environment):
    """Answers "higher" at once, for `turns` turns."""

    def __init__(self, turns: int = 4) -> None:
        self.turns, self.steps = int(turns), 0

    def step(self, action: str) -> EnvStep:
        self.steps += 1
        return EnvStep(observation="higher", reward=1.0, done=self.steps >= self.turns)


def higher_program(task: Any) -> float:
    """Higher, as an agent program talking to the endpoint (its turns: task.messages[0])."""
    client, messages = task.client(), list(task.messages)
    turns = int(task.messages[0]["content"])
    for turn in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages)
        if turn == turns - 1:
            return float(turns)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "higher"}]
    return float(turns)


def higher_program_raw(task: Any) -> float:
    """higher_program's conversation over bare http.client and json: what the endpoint costs
    without the openai client's own (its request building is most of a turn's time)."""
    import http.client
    import json
    from urllib.parse import urlsplit

    url, messages = urlsplit(task.base_url), list(task.messages)
    turns = int(task.messages[0]["content"])
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Authorization": f"Bearer {task.api_key}", "Content-Type": "application/json"}
    try:
        for turn in range(turns):
            connection.request("POST", f"{url.path}/chat/completions", headers=headers,
                               body=json.dumps({"model": "policy", "messages": messages}))
            reply = json.loads(connection.getresponse().read())
            if turn < turns - 1:
                messages += [reply["choices"][0]["message"], {"role": "user", "content": "higher"}]
    finally:
        connection.close()
    return float(turns)


def run_program_bench(*, samples: int = 32, turns: int = 4, repeats: int = 3,
                      seed: int = 0) -> dict:
    """Median seconds of the in-process environment and of the agent program, the endpoint's
    milliseconds a turn, and their ratio."""
    import tempfile

    import torch

    from executors.optable import OpContext
    from executors.torch.models.built import whole_model
    from executors.torch.rollout.engine import Engine, Sampling, run_until_done
    from executors.torch.rollout.turns import agent_of
    from flowkit.ops import AgentConfig
    from flowkit.ops.records import Prompt
    from flowkit.ops.tokenizers import load_tokenizer

    if repeats < 1 or samples < 1 or turns < 1:
        raise ValueError(f"samples, turns and repeats must be >= 1, got {samples}, {turns} "
                         f"and {repeats}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            _tiny_chat_model(Path(folder), seed)
            tokenizer = load_tokenizer(folder)
            model = whole_model(OpContext(name="bench", device="cpu", tags=()), {
                "model": "policy", "build": "executors.torch.models.hf:HFCausalLM",
                "model_config": {"path": folder}, "dtype": "float32", "seed": seed,
                "stages": 1}).eval()
            # the program learns its turns from a system message the template also shows
            chat = [{"role": "system", "content": str(turns)},
                    {"role": "user", "content": "Guess a number from 1 to 8."}]
            text = tokenizer.apply_chat_template(chat, tokenize=False,
                                                 add_generation_prompt=True)
            prompts = [Prompt(prompt_id=i, tokens=tokenizer.encode(text, add_special_tokens=False),
                              text=text, messages=chat) for i in range(samples)]
            sampling = Sampling(max_new_tokens=4, temperature=1.0, eos=None, seed=seed)
            ways = {"environment": AgentConfig(environment=f"{__name__}:Higher",
                                               env_config={"turns": turns}, max_turns=turns),
                    "program_http": AgentConfig(program=f"{__name__}:higher_program_raw",
                                                max_turns=turns),
                    "program_openai": AgentConfig(program=f"{__name__}:higher_program",
                                                  max_turns=turns)}
            seconds: dict[str, list[float]] = {way: [] for way in ways}
            tokens: dict[str, list] = {}
            for _ in range(repeats):
                for way, config in ways.items():
                    engine = Engine(model, version=lambda: None, max_batch=samples,
                                    tokenizer=tokenizer)
                    agent = agent_of(config, tokenizer)
                    start = time.perf_counter()
                    done = run_until_done({"engine": engine},
                                          engine.submit(prompts, sampling, 1, agent=agent))
                    seconds[way].append(time.perf_counter() - start)
                    if not all(r.turns == turns and r.env_error is None for r in done):
                        raise RuntimeError(f"{way}: a trajectory ended early (turns "
                                           f"{sorted({r.turns for r in done})}, errors "
                                           f"{[r.env_error for r in done if r.env_error]})")
                    tokens[way] = sorted((r.prompt_id, r.response_tokens) for r in done)
    finally:
        torch.set_num_threads(threads)
    median = {way: statistics.median(times) for way, times in seconds.items()}
    per_turn = 1e3 / (samples * turns)
    return {"samples": samples, "turns": turns, "repeats": repeats,
            **{f"{way}_s": median[way] for way in ways},
            "program_http_over_environment": median["program_http"] / median["environment"],
            "program_openai_over_environment": median["program_openai"]
            / median["environment"],
            "endpoint_ms_per_turn": per_turn * (median["program_http"] - median["environment"]),
            "openai_client_ms_per_turn": per_turn
            * (median["program_openai"] - median["program_http"]),
            "same_tokens": all(tokens[way] == tokens["environment"] for way in ways)}


def _tiny_chat_model(folder: Path, seed: int) -> None:
    """A random tiny Qwen2 with examples/qwen2_build.py's tokenizer and chat template."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = Path(__file__).resolve().parents[1] / "examples" / "qwen2_build.py"
    spec = importlib.util.spec_from_file_location("_qwen2_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    texts = ["<|im_start|>user\nGuess a number from 1 to 8.<|im_end|>\n<|im_start|>assistant\n"
             f"{n}<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n" for n in range(1, 9)]
    tokenizer = module.build_tokenizer(texts * 8)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         **{**module.QWEN2_TINY, "max_position_embeddings": 512})
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
