"""`flowkit bench rollout --engine vllm,flowkit`: each rollout engine's tokens/s on the same prompts
and Hugging Face model, and its weight sync's time per step, in one run, in this process.

Each engine serves the `generate` op as an executor runs it (executors/torch/rollout/generate.py),
under a model name of its own, from the same folder: a tiny Qwen2 built offline (heads of 32, which
vLLM's CPU attention runs) unless `model` names one. Every sample runs to max_new_tokens (no
EOS), so both make the same tokens. A step's sync is what the weights cost to reach the engine
after an optimizer step: `load_weights` into the executor's copy, and for vLLM the in-place
reload into its workers too. The first call (vLLM's start, the own engine's first cache) is
timed apart. On a CPU these figures say what the engines cost here, not how they compare on a GPU.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["ENGINES", "engines_figures"]

ENGINES = ("flowkit", "vllm")
SIZE = {"prompts": 16, "n": 8, "prompt_len": 9, "max_new_tokens": 32}
HF = "executors.torch.models.hf:HFCausalLM"


def engines_figures(engines: tuple[str, ...], *, model: str | None = None, repeats: int = 3,
                    size: dict | None = None) -> dict[str, Any]:
    import torch

    from executors.optable import OpContext

    size = size or SIZE
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise ValueError(f"unknown engine(s) {', '.join(unknown)}: they are "
                         f"{', '.join(ENGINES)}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        folder = model or _tiny_qwen2(scratch)
        ctx = OpContext(name="bench", device="cpu", tags=())
        figures = {engine: _measure(ctx, engine, folder, size, repeats) for engine in engines}
    return {"rollout_engines": {"model": "tiny Qwen2 (heads of 32)" if model is None else model,
                                **size, **figures}}


def _measure(ctx: Any, engine: str, folder: str, size: dict, repeats: int) -> dict[str, Any]:
    from executors.torch.rollout.generate import generate_now
    from flowkit.ops.records import Prompt

    spec = {"model": f"{engine}_actor", "build": HF, "model_config": {"path": folder},
            "seed": 0}
    prompts = [Prompt(prompt_id=i, tokens=[(7 * i + j) % 200 + 20
                                           for j in range(size["prompt_len"])])
               for i in range(size["prompts"])]
    settings = {"engine": engine, "n": size["n"], "max_new_tokens": size["max_new_tokens"],
                "eos": None, "temperature": 1.0, "max_batch": 256}
    started = time.perf_counter()
    generate_now(ctx, prompts[:1], **spec, **{**settings, "n": 1, "max_new_tokens": 1})
    first = time.perf_counter() - started
    times, syncs, tokens = [], [], size["prompts"] * size["n"] * size["max_new_tokens"]
    for step in range(repeats):
        syncs.append(_sync(ctx, spec, version=step + 1))
        started = time.perf_counter()
        made = generate_now(ctx, prompts, **spec, **settings, step=step)
        times.append(time.perf_counter() - started)
        assert sum(len(r.response_tokens) for r in made) == tokens, engine
    return {"start_s": round(first, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / statistics.median(times)),
            "weight_sync_s": round(statistics.median(syncs), 4)}


def _sync(ctx: Any, spec: dict, *, version: int) -> float:
    """A step's weights reaching the engine: loaded into the executor's copy (every weight
    changed, as an optimizer step changes them), then, for vLLM, into its workers."""
    import torch

    from executors.torch.models.built import held_model, load_weights
    from executors.torch.rollout.vllm_engine import VLLMEngine
    from flowkit.ops.records import WeightsVersion

    model = held_model(ctx, {**spec, "stages": 1}).parts[0]
    with torch.no_grad():
        new = {name: p.detach() * 0.999 for name, p in model.named_parameters()}
    started = time.perf_counter()
    load_weights(ctx, new, WeightsVersion(model=spec["model"], version=version), **spec,
                 stages=1)
    engine = ctx.background.get(f"generate:{spec['model']}")
    if isinstance(engine, VLLMEngine):
        engine.sync_weights()
    return time.perf_counter() - started


def _tiny_qwen2(folder: str) -> str:
    """The README's tiny Qwen2 with heads of 32 and its tokenizer, by examples/qwen2_build.py's
    own code (no download), in `folder`."""
    from benchmarks.trl import EXAMPLES

    spec = importlib.util.spec_from_file_location("_qwen2_build", EXAMPLES / "qwen2_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(Path(folder), data=EXAMPLES / "data", shape=module.QWEN2_TINY_VLLM)
    return folder
