"""LoRA adapters in a held model [Note: LoRA in flowkit/dsl/lora.py].

`add_adapters` injects them into a model built and split by models/built.py: through the model's own
``add_lora(settings)`` where it has one (a Hugging Face model: peft's, models/hf.py), else as
`LoRALinear` layers, which compute what peft's ``lora.Linear`` computes. Either way each target
``nn.Linear`` at ``P`` becomes a module with ``P.base_layer`` (the frozen layer) and ``P.lora_A``,
``P.lora_B`` (peft nests these by adapter name: ``P.lora_A.default``); every other parameter of
the model and of its stages is frozen. The stages share the whole model's layers, so one
injection reaches them all, and the split's names [Note: unsplit names in weights.py] are
rewritten to match: ``h.0.attn.c_attn.weight`` -> ``transformer.h.3.attn.c_attn.weight`` becomes
``h.0.attn.c_attn.base_layer.weight`` -> ``transformer.h.3.attn.c_attn.base_layer.weight``, with
the adapters' names beside it. The pipeline's deferred weight gradients need nothing new: the
adapters are linear layers (``F.linear``), recorded as any trained layer, and a frozen layer's
input gradient flows through autograd.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from executors.torch import weights
from executors.torch.errors import StageError

__all__ = ["LoRALinear", "adapted_layers", "adapter_dtype", "add_adapters", "merge_adapters"]


class LoRALinear(nn.Module):
    """``base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / r``, as peft's ``lora.Linear``
    computes it, with A Kaiming-uniform (a = √5, peft's default) and B zero: at first the base
    layer's own function. The adapters of a float16 or bfloat16 layer are float32, as peft's
    `autocast_adapter_dtype` keeps them (`adapter_dtype`): the input is cast up for them and
    the sum cast back to the layer's dtype."""

    def __init__(self, base: nn.Linear, *, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        like = {"device": base.weight.device, "dtype": adapter_dtype(base.weight.dtype)}
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **like)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **like)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / r
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        x = self.lora_dropout(x.to(self.lora_A.weight.dtype))
        return (result + self.lora_B(self.lora_A(x)) * self.scaling).to(result.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the adapters' update into the base layer's weight (then use `base_layer`): in
        the adapters' dtype, rounded once to the weight's (as peft merges)."""
        self.base_layer.weight += (self.lora_B.weight @ self.lora_A.weight) * self.scaling


def adapter_dtype(base: torch.dtype) -> torch.dtype:
    """The dtype of the adapters of a layer of dtype `base`: float32 for float16 and bfloat16,
    whose spacing near the adapters' values (about 2e-3 at 0.3 in bfloat16) would round away
    the small steps an optimizer takes; the layer's own dtype otherwise."""
    return torch.float32 if base in (torch.float16, torch.bfloat16) else base


def add_adapters(whole: nn.Module, parts: Sequence[nn.Module], lay: weights.Layout,
                 settings: dict) -> weights.Layout:
    """Inject `settings`' adapters into `whole` (and so into `parts`, its split sharing its
    layers), freeze every other parameter, and return `lay` (the split's names before) with
    the names after."""
    add_lora = getattr(whole, "add_lora", None)
    if add_lora is not None:
        add_lora(settings)
    else:
        _inject(whole, settings)
    paths = adapted_layers(whole)
    adapters = {id(p) for path in paths for name, p in whole.get_submodule(path).named_parameters()
                if ".lora_" in f".{name}"}
    for module in (whole, *parts):
        for p in module.parameters():
            p.requires_grad_(id(p) in adapters)
    return _renamed(lay, whole, parts, paths)


def merge_adapters(whole: nn.Module) -> None:
    """Fold every adapter into its base layer and put the base layer back in its place: the
    model's own names and function, with the update added in."""
    for path in adapted_layers(whole):
        layer = whole.get_submodule(path)
        layer.merge()
        parent, _, leaf = path.rpartition(".")
        setattr(whole.get_submodule(parent) if parent else whole, leaf, layer.base_layer)


def _inject(whole: nn.Module, settings: dict) -> None:
    targets = settings["target_modules"]
    found = [(name, module) for name, module in whole.named_modules()
             if any(name == t or name.endswith("." + t) for t in targets)]
    if not found:
        linear = sorted({name.rpartition(".")[2] for name, m in whole.named_modules()
                         if isinstance(m, nn.Linear)})
        raise StageError(f"lora target_modules {targets} match no layer of the "
                         f"{type(whole).__name__}; its linear layers are named {linear}")
    for name, module in found:
        if not isinstance(module, nn.Linear):
            raise StageError(f"lora target {name!r} is a {type(module).__name__}, not an "
                             "nn.Linear: LoRA adapts linear layers only")
        parent, _, leaf = name.rpartition(".")
        setattr(whole.get_submodule(parent) if parent else whole, leaf, LoRALinear(
            module, r=settings["r"], alpha=settings["alpha"], dropout=settings["dropout"]))


def adapted_layers(whole: nn.Module) -> list[str]:
    """Paths of the layers that carry adapters (ours or peft's)."""
    return [name for name, m in whole.named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


def _renamed(lay: weights.Layout, whole: nn.Module, parts: Sequence[nn.Module],
             paths: list[str]) -> weights.Layout:
    lay.check()
    inside = {path: [name for name, _ in whole.get_submodule(path).named_parameters()]
              for path in paths}
    stages: list[dict[str, str]] = []
    for mapping in lay.names:
        names: dict[str, str] = {}
        for local, unsplit in mapping.items():
            layer, _, _ = unsplit.rpartition(".")
            if layer not in inside:
                names[local] = unsplit
                continue
            local_layer = local.rpartition(".")[0]
            for name in inside[layer]:
                names[f"{local_layer}.{name}"] = f"{layer}.{name}"
        stages.append(names)
    return weights.checked_layout(whole, parts, stages)
