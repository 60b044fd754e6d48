"""Hugging Face causal LMs as Models: the `build="hf"` shorthand, and the checks that turn a model
directory flowkit cannot use into one clear error when the Model is declared, before any executor
starts. Pure Python (it reads config.json); the model code is executors/torch/models/hf.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "HF_BUILD", "check_family", "check_hf_config", "check_model_dir"]

HF_BUILD = "executors.torch.models.hf:HFCausalLM"

# model_type -> how its decoder is laid out: "rope" (Llama and the families generated from it) or
# "gpt2" (absolute positions, blocks under transformer.h)
FAMILIES = {"llama": "rope", "qwen2": "rope", "qwen3": "rope", "mistral": "rope", "gpt2": "gpt2"}


def check_model_dir(path: str | Path) -> str:
    """The model_type of the HF model directory `path`, or a ValueError saying what is wrong:
    no such directory, no config.json, or an architecture flowkit cannot split."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"Hugging Face model {str(path)!r}: no such directory (give the folder "
                         "save_pretrained wrote; nothing is downloaded)")
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"Hugging Face model {str(path)!r} has no config.json: give the folder "
                         "save_pretrained wrote (config.json beside the weights)")
    return check_family(json.loads(config.read_text()).get("model_type"), str(path))


def check_family(model_type: Any, where: str) -> str:
    if model_type not in FAMILIES:
        raise ValueError(f"Hugging Face model {where!r} is a {model_type!r}, which flowkit cannot "
                         f"split into pipeline stages; supported: {', '.join(sorted(FAMILIES))} "
                         "(decoder-only causal LMs)")
    return model_type


def check_hf_config(config: Mapping[str, Any]) -> None:
    """A Model(build="hf")'s config names a usable model: `path` (a save_pretrained folder) or
    `architecture` (with `hf_config`, a random one), exactly one."""
    path, architecture = config.get("path"), config.get("architecture")
    if (path is None) == (architecture is None):
        raise ValueError("Model(build='hf') takes config={'path': DIR} (a save_pretrained folder) "
                         "or {'architecture': NAME, 'hf_config': {...}} (random weights), exactly "
                         "one")
    if path is not None:
        check_model_dir(path)
    else:
        check_family(architecture, str(architecture))
