"""What generation (generate.py) and scoring (infer.py) ask of a model, and the checks that turn
a model that does not fit into an error saying how to fix it.

The design: [Note: generation and scoring interface] below.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["check_prompts", "context_length", "has_cache", "logits_of", "reads_last", "values_of"]


# [Note: generation and scoring interface] The model is the `build` result's one-stage split (or
# the module itself without `split`), as executors/torch/models/built.py `whole_model` gives it:
# - ``forward(tokens)`` (B, T) -> logits (B, T, V), or values (B, T) for a critic or reward model
#   (told apart by shape). Rows are right-padded with token 0, so the model must be causal;
# - ``context_length`` (optional; None: unlimited): a prompt with no room for one new token is an
#   error, a response that reaches it is cut (``clipped``);
# - the cache protocol (optional, both methods or neither), so decoding costs one token a step:
#   ``new_cache(batch, max_len)`` and ``forward_cached(tokens, cache, start, rows)``, which writes
#   new tokens of rows `rows` from positions `start` and returns their logits; a query at p sees
#   positions <= p of its own row; a pad's write past its row's end is overwritten by the next
#   real token; writing from start 0 begins a new sequence. An optional ``copy_prefix(src, dst,
#   length)``, ``grown(batch, max_len)`` and a keyword ``last`` of ``forward_cached`` are
#   optional speed-ups. The GPT implements it all ([Note: KV cache rows] in
#   executors/torch/models/gpt.py); a recurrent model leaves it out and recomputes. In full,
#   each option too: docs/training.md, "Your own model".


def context_length(model: torch.nn.Module) -> int | None:
    """The model's `context_length`, or None when it has none (unlimited)."""
    length = getattr(model, "context_length", None)
    return None if length is None else int(length)


def has_cache(model: torch.nn.Module) -> bool:
    """Whether the model implements the cache protocol (both `new_cache` and
    `forward_cached`)."""
    return callable(getattr(model, "new_cache", None)) and \
        callable(getattr(model, "forward_cached", None))


def reads_last(model: torch.nn.Module) -> bool:
    """Whether the model's `forward_cached` takes the keyword `last` (and `start` on the host)
    [Note: generation and scoring interface]."""
    try:
        return "last" in inspect.signature(model.forward_cached).parameters
    except (AttributeError, TypeError, ValueError):  # no forward_cached, or no signature
        return False


def check_prompts(prompts: list, context: int | None) -> None:
    """Every prompt has a token to start from and room for one more within the context."""
    empty = [p.prompt_id for p in prompts if not p.tokens]
    if empty:
        raise ValueError(f"prompts {empty} are empty: generation starts from at least one token")
    if context is None:
        return
    long = [f"{p.prompt_id} ({len(p.tokens)} tokens)" for p in prompts
            if len(p.tokens) >= context]
    if long:
        which = f"prompt {long[0]} leaves" if len(long) == 1 else \
            f"prompts {', '.join(long[:5])}{', ...' if len(long) > 5 else ''} leave"
        raise ValueError(f"{which} no room to generate within the model's context_length "
                         f"{context}: use prompts shorter than {context} tokens, or a model "
                         "with a longer context")


def logits_of(out: torch.Tensor, op: str) -> torch.Tensor:
    """`out` as logits (B, T, V), or an error when the model gave values (a critic)."""
    if out.dim() == 3 and out.size(-1) > 1:
        return out
    raise ValueError(f"{op} needs a language model whose forward(tokens) returns logits "
                     f"(B, T, V), but this one returned shape {tuple(out.shape)}: values, so "
                     "a critic or reward model; run it with values or reward_model instead")


def values_of(out: torch.Tensor, op: str) -> torch.Tensor:
    """`out` as values (B, T), or an error when the model gave logits (a language model)."""
    if out.dim() == 3 and out.size(-1) == 1:
        out = out.squeeze(-1)
    if out.dim() == 2:
        return out
    raise ValueError(f"{op} needs a critic whose forward(tokens) returns values (B, T), but "
                     f"this model returned shape {tuple(out.shape)}: logits, so a language "
                     "model. Give it a value head (the built-in GPT takes value_head=True in "
                     "its model config)")
