"""What a step's MFU is made of, on the executor: the model FLOPs a token costs, the tokens this
executor's first stages ran since the last ask, and the device's peak.

[Note: model FLOPs] As PaLM (appendix B) and nanoGPT's `estimate_mfu` count them: a token of
training costs 6N FLOPs for the N weights it multiplies (2 forward, 4 backward; the position
table is a lookup and left out, a tied embedding counted once as the LM head), and its attention
to T positions 12·L·C·T (L layers of width C). Recomputation is not counted: this is the model's
work, not the hardware's. The tokens are those stage 0 ran, padding included (the stages compute
on it); the runner divides their FLOPs by the step's seconds and the devices' peaks
(flowkit/runner/stepreport.py).
"""

from __future__ import annotations

from typing import Any

import torch

from executors.optable import OpContext
from executors.torch.device import peak_flops

__all__ = ["flops_per_token", "model_flops", "non_embedding_parameters"]

# a model config's number of layers, width and context length, by the names models give them
_LAYERS = ("n_layer", "num_hidden_layers")
_WIDTH = ("n_embd", "hidden_size")
_CONTEXT = ("block_size", "max_position_embeddings")
_POSITION_TABLE = "wpe.weight"  # a learned position embedding: a lookup, no multiply


def non_embedding_parameters(parts: list[torch.nn.Module]) -> int:
    """The model's weights over its stages, each counted once: a parameter shared by stages
    (or tied within one) once, a later stage's copy of a tied weight not at all, the position
    table not at all [Note: model FLOPs]."""
    copies = {(len(parts) - 1, name)
              for name in dict(getattr(parts[-1], "tied_pairs", dict)()).values()}
    seen: dict[int, int] = {}
    for index, part in enumerate(parts):
        for name, p in part.named_parameters():
            if (index, name) not in copies and not name.endswith(_POSITION_TABLE):
                seen[id(p)] = p.numel()
    return sum(seen.values())


def flops_per_token(parts: list[torch.nn.Module], seq_len: int | None = None) -> float | None:
    """Training FLOPs a token costs [Note: model FLOPs]: 6N + 12·L·C·T, T the run's sequence
    length where given, else the model's context; None when its config names no layers or
    width."""
    config = getattr(parts[0], "config", None)
    layers, width = _first(config, _LAYERS), _first(config, _WIDTH)
    context = seq_len or _first(config, _CONTEXT)
    if not (layers and width and context):
        return None
    return 6.0 * non_embedding_parameters(parts) + 12.0 * layers * width * context


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_flops(ctx: OpContext, *_: Any, model: str, reset: bool = True) -> dict:
    """The op: {"flops_per_token", "tokens" stage 0 ran here since the last reset, "peak_flops"
    of this executor's device} for `model`; None for what is unknown."""
    per_token, tokens = None, 0
    for (name, _), held in ctx.state.get("torch_models", {}).items():
        if name != model:
            continue
        per_token = per_token or flops_per_token(held.parts, held.config.get("seq_len"))
        first = held.stages.get(0)
        if first is not None:
            tokens += first.tokens_run
            if reset:
                first.tokens_run = 0
    return {"flops_per_token": per_token, "tokens": tokens, "peak_flops": peak_flops(ctx.device)}
