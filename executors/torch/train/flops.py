"""What a step's MFU is made of, on the executor: the model FLOPs a token costs, the tokens this
executor's first stages ran since the last ask, and the device's peak.

[Note: model FLOPs] As PaLM (appendix B) and nanoGPT's `estimate_mfu` count them: a token of
training costs 6N FLOPs for the N weights it multiplies (2 forward, 4 backward; an input
embedding or position table is a lookup and left out, unless tied to the LM head: then once),
and its attention to the T positions of its row 12·L·C·T (L layers of width C), so a (B, T)
microbatch adds 12·L·C·B·T². The rows are those stage 0 ran, padding included (the stages
compute on it); the runner divides the FLOPs by the step's seconds and the devices' peaks
(flowkit/runner/stepreport.py). Recomputation is not counted: the model's work, not the
hardware's.
"""

from __future__ import annotations

from typing import Any

import torch

from executors.optable import OpContext
from executors.torch.device import peak_flops

__all__ = ["model_flops", "non_embedding_parameters", "training_flops"]

# a model config's number of layers, width and context length, by the names models give them
_LAYERS = ("n_layer", "num_hidden_layers")
_WIDTH = ("n_embd", "hidden_size")
_LOOKUPS = ("wpe.weight", "wte.weight", "embed_tokens.weight")  # tables a token indexes


def non_embedding_parameters(parts: list[torch.nn.Module]) -> int:
    """The model's weights over its stages, each counted once: a parameter shared by stages
    (or tied within one) once, a later stage's copy of a tied weight not at all, a lookup table
    (position, or an input embedding not tied to the LM head) not at all [Note: model FLOPs]."""
    pairs = dict(getattr(parts[-1], "tied_pairs", dict)())  # stage 0's name -> its copy's
    copies = {(len(parts) - 1, name) for name in pairs.values()}
    seen: dict[int, int] = {}
    for index, part in enumerate(parts):
        names: dict[int, list[str]] = {}
        params = {}
        for name, p in part.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
        for key, given in names.items():
            if any((index, name) in copies for name in given):
                continue
            tied = len(given) > 1 or (index == 0 and given[0] in pairs)
            if all(name.endswith(_LOOKUPS) for name in given) and not tied:
                continue
            seen[key] = params[key].numel()
    return sum(seen.values())


def training_flops(parts: list[torch.nn.Module], tokens: int, attended: int) -> float | None:
    """Training FLOPs of `tokens` tokens in rows whose squared lengths sum to `attended`
    [Note: model FLOPs]: 6N·tokens + 12·L·C·ΣT²; None when the model's config names no layers
    or width."""
    config = getattr(parts[0], "config", None)
    layers, width = _first(config, _LAYERS), _first(config, _WIDTH)
    if not (layers and width):
        return None
    return 6.0 * non_embedding_parameters(parts) * tokens + 12.0 * layers * width * attended


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_flops(ctx: OpContext, *_: Any, model: str, reset: bool = True) -> dict:
    """The op: {"flops" of the rows stage 0 ran here since the last reset, "tokens", "peak_flops"
    of this executor's device} for `model`; None for what is unknown."""
    flops, tokens = None, 0
    for (name, _), held in ctx.state.get("torch_models", {}).items():
        first = held.stages.get(0) if name == model else None
        if first is None:
            continue
        ran = training_flops(held.parts, first.tokens_run, first.attended)
        flops = None if ran is None else (flops or 0.0) + ran
        tokens += first.tokens_run
        if reset:
            first.tokens_run = first.attended = 0
    return {"flops": flops, "tokens": tokens, "peak_flops": peak_flops(ctx.device)}
