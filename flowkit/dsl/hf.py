"""Hugging Face causal LMs as Models: the `build="hf"` shorthand, and the checks that turn a model
directory flowkit cannot use into one clear error when the Model is declared, before any executor
starts; the same for a tokenizer folder a prompt source reads (`check_tokenizer_dir`). Pure Python
(it reads config.json, tokenizer_config.json, chat_template.jinja); the model code is
executors/torch/models/hf.py, the tokenizer loader flowkit/ops/tokenizers.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "HF_BUILD", "check_family", "check_hf_config", "check_model_dir",
           "check_tokenizer_dir", "has_chat_template", "has_tokenizer"]

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


# the files one of which a tokenizer folder holds: a fast tokenizer's, or a slow one's vocabulary
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(path: str | Path) -> bool:
    """Whether the folder `path` holds a tokenizer (save_pretrained's files)."""
    folder = Path(path)
    return folder.is_dir() and any((folder / name).is_file() for name in _TOKENIZER_MARKERS)


def has_chat_template(path: str | Path) -> bool:
    """Whether the tokenizer in `path` has a chat template: in chat_template.jinja (what
    transformers 5 writes), chat_template.json, or tokenizer_config.json's `chat_template`."""
    folder = Path(path)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (ValueError, AttributeError):
        return False


def check_tokenizer_dir(path: Any, *, chat_template: bool = False) -> None:
    """A ValueError saying what is wrong when the folder `path` holds no tokenizer flowkit can
    load offline, or (`chat_template`) one without a chat template."""
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        raise ValueError(f"tokenizer {str(path)!r}: no such directory (give the folder "
                         "save_pretrained wrote the tokenizer to, e.g. the model's; nothing is "
                         "downloaded)")
    if not has_tokenizer(path):
        raise ValueError(f"tokenizer {str(path)!r} holds no tokenizer (none of "
                         f"{', '.join(_TOKENIZER_MARKERS)}): save one there with "
                         "tokenizer.save_pretrained(DIR)")
    if chat_template and not has_chat_template(path):
        raise ValueError(f"tokenizer {str(path)!r} has no chat template (no chat_template.jinja, "
                         "no chat_template in tokenizer_config.json): set "
                         "tokenizer.chat_template and save it again, or pass "
                         "chat_template=False to use the prompts as they are")
