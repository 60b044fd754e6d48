"""LoRA settings of a `Model` (``Model(..., lora={"r": 16, "target_modules": [...]})``),
checked when the model is declared: a run never starts with settings an executor would refuse.

[Note: LoRA] A model with `lora` trains low-rank adapters only (Hu et al., 2021, "LoRA: Low-Rank
Adaptation of Large Language Models"): each target linear layer W keeps its weights frozen and
adds B·A·x·(alpha / r), with A (r × in) drawn as peft draws it and B (out × r) zero, so training
starts from the base model's function. The executors inject the adapters right after building the
model, through peft for Hugging Face models and flowkit's own `LoRALinear` for the built-in GPT
and other models (executors/torch/lora.py); the pipeline ops run as before, and only the adapters
take gradients, optimizer state, weight syncs to generation, and the saved adapter folder.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["LORA_KEYS", "check_lora", "lora_identity"]

LORA_KEYS = {
    "r": "the adapters' rank (an int >= 1)",
    "alpha": "the scale numerator: the update is B·A·x·(alpha / r) (default: r, a scale of 1)",
    "target_modules": "names of the linear layers to adapt, matched as peft matches them: a "
                      "layer whose name is one of these or ends with '.' + one of these",
    "dropout": "dropout on the adapters' input while training, 0 <= p < 1 (default 0)",
    "save": "what --save-weights writes: 'adapter' (a peft adapter folder for a Hugging Face "
            "model, the adapter tensors for others; the default) or 'merged' (the base "
            "weights with the adapters added in)",
}
_SAVES = ("adapter", "merged")
_HEADS = ("lm_head", "score")  # a split's last stage holds its own copy of a tied head


def lora_identity(settings: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What of the settings makes the model: all but `save`, which only says how to write it."""
    return None if settings is None else {k: v for k, v in settings.items() if k != "save"}


def check_lora(value: Any, *, model: str) -> dict[str, Any] | None:
    """`value` as the executors take it (every key present, plain values), or ValueError
    saying what is wrong with it."""
    if value is None:
        return None
    where = f"Model {model!r}: lora"
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a dict such as {{'r': 16, 'alpha': 32, "
                         f"'target_modules': ['q_proj', 'v_proj']}}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(LORA_KEYS))
    if unknown:
        raise ValueError(f"{where} has no setting {', '.join(map(repr, unknown))}; its settings "
                         f"are {', '.join(LORA_KEYS)}")
    if "r" not in value or "target_modules" not in value:
        raise ValueError(f"{where} needs 'r' (the rank) and 'target_modules' (e.g. ['q_proj', "
                         "'v_proj'] for a Hugging Face model, ['c_attn'] for the built-in GPT)")
    r = value["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r={r!r} must be an int >= 1 (8 to 64 are usual)")
    alpha = value.get("alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
            0 < alpha < math.inf):
        raise ValueError(f"{where}: alpha={alpha!r} must be a number > 0 (often 2 × r)")
    targets = value["target_modules"]
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets or not all(
            isinstance(t, str) and t for t in targets):
        raise ValueError(f"{where}: target_modules={targets!r} must be a non-empty list of "
                         "layer names, e.g. ['q_proj', 'v_proj']")
    heads = sorted(set(targets) & set(_HEADS))
    if heads:
        raise ValueError(f"{where}: target_modules names the output head {heads[0]!r}; adapt "
                         "the decoder layers' projections instead (a pipeline's last stage "
                         "holds its own copy of a tied head)")
    dropout = value.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{where}: dropout={dropout!r} must be a number in [0, 1)")
    save = value.get("save", "adapter")
    if save not in _SAVES:
        raise ValueError(f"{where}: save={save!r} must be one of {', '.join(map(repr, _SAVES))}")
    return {"r": r, "alpha": float(alpha), "target_modules": list(dict.fromkeys(targets)),
            "dropout": float(dropout), "save": save}
