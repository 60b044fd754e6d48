"""Tokenizers of Hugging Face model folders, for the processes that tokenize (a prompt source)
or decode (generation): each folder loaded once per process, offline.

transformers is imported only when a tokenizer is loaded (the `hf` extra); declaring a flow never
loads one, its folder is checked by flowkit/dsl/hf.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from flowkit.dsl.hf import check_tokenizer_dir

__all__ = ["eos_token_ids", "load_tokenizer"]


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer saved in `folder` (AutoTokenizer, local files only), loaded once per
    process: every call for the same folder returns the same object, so change a copy."""
    return _load(str(Path(folder).resolve()))


def eos_token_ids(folder: str | Path) -> tuple[int, ...]:
    """The tokens that end a response of the model in `folder`: its tokenizer's EOS and those
    its generation_config.json names (chat models often end a turn with another token than the
    tokenizer's EOS, and list both there)."""
    return _eos(str(Path(folder).resolve()))


@functools.cache
def _load(folder: str) -> Any:
    check_tokenizer_dir(folder)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("tokenizers of model folders need transformers in this process: "
                         "pip install 'flowkit[hf]'") from None
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@functools.cache
def _eos(folder: str) -> tuple[int, ...]:
    ids = []
    eos = _load(folder).eos_token_id
    if eos is not None:
        ids.append(int(eos))
    generation = Path(folder) / "generation_config.json"
    if generation.is_file():
        named = json.loads(generation.read_text()).get("eos_token_id")
        ids += [int(t) for t in (named if isinstance(named, list) else [named]) if t is not None]
    return tuple(dict.fromkeys(ids))  # each once, the tokenizer's first
