"""Hugging Face folders built offline for the tests: a tiny byte-level BPE tokenizer trained with
`tokenizers` (with EOS, pad and a short chat template) and a tiny random Qwen2 beside it, saved
with save_pretrained, as a model folder users would give flowkit."""

from __future__ import annotations

from pathlib import Path

_CORPUS = ["What is 2+3? The answer is 5.", "Sort the digits 419: 149", "hello world",
           "user assistant system", "Answer with one word: yes or no."]


def save_tokenizer(folder: str | Path, *, chat_template: bool = True, vocab_size: int = 300):
    """A byte-level BPE tokenizer (EOS <|im_end|>, pad <|endoftext|>) saved in `folder`, with
    the example's ChatML template (examples/qwen2_build.py) or none; returns it (a
    transformers fast tokenizer)."""
    from examples.qwen2_build import CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(_CORPUS * 4, vocab_size=vocab_size,
                                chat_template=CHAT_TEMPLATE if chat_template else None)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


# a tiny Qwen2 whose attention heads vLLM's CPU attention runs (head size 32, not 16 or 4)
VLLM_SHAPE = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 128}


def save_tiny_qwen2(folder: str | Path, *, chat_template: bool = True, seed: int = 0,
                    shape: dict | None = None) -> Path:
    """A tiny random Qwen2 (2 layers, width 16, or as `shape` says) and its tokenizer in
    `folder`; its vocabulary is the tokenizer's, its EOS the tokenizer's."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    folder = Path(folder)
    tokenizer = save_tokenizer(folder, chat_template=chat_template)
    sizes = shape or {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "intermediate_size": 32}
    config = Qwen2Config(**sizes, num_hidden_layers=2, vocab_size=len(tokenizer),
                         max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id,
                         # wide initial weights: a random model whose greedy text varies
                         initializer_range=0.5)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder
