"""Hugging Face causal LMs as flowkit models: `HFCausalLM` loads one (Llama, Qwen2, Qwen3, Mistral,
GPT-2) from a local directory, or builds a tiny random one from a config, and cuts it into pipeline
stages by decoder layers. Flows name it ``Model(build="hf", config={"path": DIR})``.

The design: [Note: Hugging Face stages] below.
"""

from __future__ import annotations

import functools
import inspect
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from executors.torch.device import build_target, to_device
from executors.torch.models.gpt import (
    CacheWindow,
    _balanced,
    _enlarged,
    at_positions,
    cache_dtype,
    cache_positions,
)
from executors.torch.models.packing import BlockCausal
from flowkit.dsl.hf import FAMILIES, check_family, check_model_dir

__all__ = ["HFCausalLM", "HFModelError", "HFStage", "RowCache"]


# [Note: Hugging Face stages] The whole model is the HF model's own modules re-hung under the same
# attribute names (``model.layers.3``, ``lm_head``, GPT-2's ``transformer.h.3``), so every
# parameter keeps its HF name in the whole model and in every stage: weights sync, export and
# load by the names `save_pretrained` writes (weights.py maps names identically). A stage holds
# the embeddings if first, a contiguous run of decoder layers keyed by their global index (so
# ``self_attn.layer_idx`` stays the unsplit model's), the final norm and LM head if last; the
# rotary embedding is on every stage. Layers are called with keywords only, as HF's forward does,
# with an explicit additive mask (causal, within a sliding layer's window). Inputs and loss are
# the GPT's [Note: GPT stage inputs in gpt.py]; tied embeddings as its [Note: tied embedding
# across stages]; ``value_head=True`` replaces the LM head with ``score`` (hidden -> 1).
# Generation uses the cache protocol of [Note: generation and scoring interface in rollout/lm.py]
# through `RowCache`, the layers' ``past_key_values``: ``update(keys, values, layer_idx)`` writes
# each row's new positions into its preallocated row ([Note: KV cache rows in gpt.py]). Nothing
# is fetched from a hub (``local_files_only``); transformers is imported only when such a model
# is built. In full: docs/training.md, "Hugging Face models".

class HFModelError(ValueError):
    """A Hugging Face model that cannot be loaded or split; the message says how to fix it."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "generation_config.json")


class HFCausalLM(nn.Module):
    """``HFCausalLM(path=DIR)`` or ``HFCausalLM(architecture="qwen2", hf_config={...})``.

    `value_head` swaps the LM head for a one-value head; `attn_implementation` is HF's
    ("sdpa" or "eager"). The forward is the GPT's: ``forward(idx, targets=None)``."""

    def __init__(self, path: str | None = None, *, architecture: str | None = None,
                 hf_config: dict | None = None, value_head: bool = False,
                 attn_implementation: str = "sdpa") -> None:
        super().__init__()
        lm = _load(path, architecture, hf_config or {}, attn_implementation)
        self.config = lm.config
        self.family = FAMILIES[self.config.model_type]
        self.path = None if path is None else str(path)
        self.value_head = bool(value_head)
        self._lm = [lm]  # the HF model itself, outside the module tree (save_pretrained)
        base = lm.transformer if self.family == "gpt2" else lm.model
        setattr(self, _base_name(self.family), base)
        if value_head:
            self.score = nn.Linear(self.config.hidden_size, 1, bias=False)
            nn.init.normal_(self.score.weight, std=getattr(self.config, "initializer_range", .02))
        else:
            self.lm_head = lm.lm_head
        embed = base.wte if self.family == "gpt2" else base.embed_tokens
        self.tied = not value_head and lm.lm_head.weight is embed.weight
        self._whole: list[HFStage] = []

    # -- the model contract (README, "Your own model") -------------------------------------------
    @property
    def base(self) -> nn.Module:
        return getattr(self, _base_name(self.family))

    @property
    def head(self) -> nn.Linear:
        return self.score if self.value_head else self.lm_head

    def layers(self) -> list[nn.Module]:
        return list(self.base.h if self.family == "gpt2" else self.base.layers)

    def split(self, stages: int, *, seq_len: int | None = None) -> list[HFStage]:
        counts = self.layers_per_stage(stages, seq_len=seq_len)
        head = self.head
        if stages > 1 and self.tied:  # [Note: tied embedding across stages in gpt.py]
            head = nn.Linear(head.in_features, head.out_features, bias=False)
            head = head.to(device=self.head.weight.device, dtype=self.head.weight.dtype)
            with torch.no_grad():
                head.weight.copy_(self.head.weight)
        out, start = [], 0
        for s, k in enumerate(counts):
            out.append(HFStage(self, range(start, start + k), first=s == 0,
                               last=s == stages - 1, head=head))
            start += k
        return out

    def stage_names(self, stages: int, *, seq_len: int | None = None) -> list[dict[str, str]]:
        """Every stage names its parameters as the HF model does [Note: Hugging Face stages]."""
        counts = self.layers_per_stage(stages, seq_len=seq_len)
        names = [name for name, _ in self.named_parameters(remove_duplicate=False)]
        layer_prefix = "transformer.h." if self.family == "gpt2" else "model.layers."
        head = "score." if self.value_head else "lm_head."
        out, start = [], 0
        for s, k in enumerate(counts):
            mine = {}
            for name in names:
                if name.startswith(layer_prefix):
                    keep = start <= int(name[len(layer_prefix):].split(".")[0]) < start + k
                elif name.startswith(head):
                    keep = s == stages - 1
                else:
                    keep = (s == 0) if _is_embedding(name) else (s == stages - 1)
                if keep:
                    mine[name] = name
            out.append(mine)
            start += k
        return out

    def layers_per_stage(self, stages: int, *, seq_len: int | None = None) -> list[int]:
        """Decoder layers per stage minimizing the most expensive stage, by forward FLOPs per
        token (as the GPT's `layers_per_stage`): a layer's projections and attention, the head."""
        n = self.config.num_hidden_layers
        if not 1 <= stages <= n:
            raise HFModelError(f"a {self.config.model_type} of {n} decoder layers splits into 1 "
                               f"to {n} pipeline stages, not {stages}: use --stages {n} or fewer")
        hidden = self.config.hidden_size
        inner = getattr(self.config, "intermediate_size", None) or 4 * hidden
        T = seq_len or self.context_length
        layer = 8 * hidden * hidden + 6 * hidden * inner + 4 * T * hidden
        extra = [0.0] * stages
        extra[0] += 4 * hidden
        extra[-1] += 2 * hidden * self.head.out_features
        return _balanced(n, layer, extra)

    @property
    def context_length(self) -> int:
        return _context_length(self.config)

    def whole(self) -> HFStage:
        """The model as one stage (sharing its parameters), for forward and generation."""
        if not self._whole:
            self._whole.append(HFStage(self, range(self.config.num_hidden_layers), first=True,
                                       last=True, head=self.head))
        return self._whole[0]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        return self.whole()(idx, targets, positions)

    def new_cache(self, batch: int, max_len: int) -> RowCache:
        return self.whole().new_cache(batch, max_len)

    def forward_cached(self, idx, cache, start, rows=None, *, last=None):
        return self.whole().forward_cached(idx, cache, start, rows, last=last)

    # -- LoRA [Note: LoRA in flowkit/dsl/lora.py] --------------------------------------------
    def add_lora(self, settings: dict) -> None:
        """peft's adapters in the HF model's own layers, which every stage shares."""
        try:
            from peft.functional import cast_adapter_dtype, inject_adapter_in_model
        except ImportError:
            raise HFModelError("LoRA on a Hugging Face model needs peft >= 0.20 on every "
                               "executor: pip install 'flowkit[hf]'") from None
        try:
            inject_adapter_in_model(_lora_config(settings), self._lm[0])
        except ValueError as exc:
            linear = sorted({name.rpartition(".")[2] for name, m in self.named_modules()
                             if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
                            - {"lm_head", "score"})
            why = "match no layer" if "not found" in str(exc) else (
                "name a layer peft cannot adapt (linear, embedding and convolution layers)")
            raise HFModelError(f"lora target_modules {settings['target_modules']} {why} of "
                               f"this {self.config.model_type}; its linear layers are named "
                               f"{linear}") from None
        # float16 / bfloat16 adapters up to float32, as get_peft_model's autocast_adapter_dtype
        cast_adapter_dtype(self._lm[0], "default")

    def save_lora(self, folder: str | Path, settings: dict,
                  adapters: dict[str, torch.Tensor]) -> Path:
        """Write `adapters` (by this model's names, as a LoRA split exports them) as a peft
        adapter folder (adapter_config.json, adapter_model.safetensors) that
        ``PeftModel.from_pretrained(base, folder)`` loads onto this model's base weights. Call
        it on a model without adapters of its own."""
        from peft import get_peft_model

        wrapped = get_peft_model(self._lm[0], _lora_config(settings))
        state = {f"base_model.model.{name}": value for name, value in adapters.items()}
        own = {n for n, p in wrapped.named_parameters() if p.requires_grad}
        if set(state) != own:
            odd = sorted(set(state) ^ own)[:3]
            raise HFModelError(f"the adapters to save do not match lora {settings} on this "
                               f"model (e.g. {odd})")
        wrapped.load_state_dict(state, strict=False)
        folder = Path(folder)
        wrapped.save_pretrained(folder)
        return folder

    # -- export ------------------------------------------------------------------------------
    @property
    def pretrained_format(self) -> bool:
        """Whether `save_pretrained` can write it (built.py's save_weights asks): a causal LM
        can, a value-head model cannot."""
        return not self.value_head

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write an HF directory (config.json, model.safetensors, and the tokenizer files of
        the directory it was loaded from) that `AutoModelForCausalLM.from_pretrained` loads."""
        if self.value_head:
            raise HFModelError("a value-head model (a critic) is not a causal LM: it has no HF "
                               "checkpoint format to save as; save the policy instead")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._lm[0].save_pretrained(folder)
        if self.path is not None:
            for name in TOKENIZER_FILES:
                if (Path(self.path) / name).is_file():
                    shutil.copy2(Path(self.path) / name, folder / name)
        return folder


def _lora_config(settings: dict) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=settings["r"], lora_alpha=settings["alpha"],
                      target_modules=list(settings["target_modules"]),
                      lora_dropout=settings["dropout"], bias="none")


def _base_name(family: str) -> str:
    return "transformer" if family == "gpt2" else "model"


def _is_embedding(name: str) -> bool:
    return name.split(".")[1] in ("embed_tokens", "wte", "wpe")


def _load(path: str | None, architecture: str | None, hf_config: dict,
          attn_implementation: str) -> nn.Module:
    if (path is None) == (architecture is None):
        raise HFModelError("an HF model takes path=DIR (a save_pretrained folder) or "
                           "architecture=NAME with hf_config={...} (a random one), exactly one")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise HFModelError("Hugging Face models need transformers on every executor: "
                           "pip install 'flowkit[hf]'") from None
    # an executor's stderr is the run's console: no progress bar per loaded model
    hf_logging.disable_progress_bar()
    if path is not None:
        check_model_dir(path)
        device, dtype = build_target()  # [Note: models from a checkpoint in built.py]
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation,
            device_map=None if device.type == "cpu" else device)
    check_family(architecture, architecture)
    config = AutoConfig.for_model(architecture, **hf_config)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                            dtype=torch.float32)


class HFStage(nn.Module):
    """A contiguous slice of an `HFCausalLM` [Note: Hugging Face stages]."""

    def __init__(self, whole: HFCausalLM, layers: range, *, first: bool, last: bool,
                 head: nn.Linear) -> None:
        super().__init__()
        self.config, self.family, self.first, self.last = whole.config, whole.family, first, last
        self.value_head, self.tied = whole.value_head, whole.tied
        base, container = whole.base, nn.Module()
        all_layers = whole.layers()
        blocks = nn.ModuleDict({str(i): all_layers[i] for i in layers})
        self._rotary = [getattr(base, "rotary_emb", None)]  # buffers only: shared, not held
        if self.family == "gpt2":
            container.h = blocks
            if first:
                container.wte, container.wpe, container.drop = base.wte, base.wpe, base.drop
            if last:
                container.ln_f = base.ln_f
        else:
            container.layers = blocks
            if first:
                container.embed_tokens = base.embed_tokens
            if last:
                container.norm = base.norm
        setattr(self, _base_name(self.family), container)
        if last:
            setattr(self, "score" if self.value_head else "lm_head", head)
        self._windows = {i: _window(self.config, i) for i in layers}
        self._cache_keyword = _cache_keyword(next(iter(self.blocks.values()), None))

    @property
    def container(self) -> nn.Module:
        return getattr(self, _base_name(self.family))

    @property
    def blocks(self) -> nn.ModuleDict:
        c = self.container
        return c.h if self.family == "gpt2" else c.layers

    def tied_copies(self) -> tuple[str, ...]:
        """Its copy of the tied embedding/head weight, in a split of several stages
        [Note: tied embedding across stages in gpt.py]."""
        if not self.tied or self.first == self.last:
            return ()
        return (self._embedding_name,) if self.first else ("lm_head.weight",)

    def tied_pairs(self) -> dict[str, str]:
        """On the last stage: the first stage's tied parameter -> this stage's copy."""
        return {self._embedding_name: "lm_head.weight"} if self.tied_copies() and self.last \
            else {}

    @property
    def _embedding_name(self) -> str:
        return f"{_base_name(self.family)}.{'wte' if self.family == 'gpt2' else 'embed_tokens'}" \
            ".weight"

    @property
    def context_length(self) -> int:
        return _context_length(self.config)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """With `positions` (B, T), packed rows: each sequence's own rotary positions and a
        block-diagonal causal mask [Note: packed rows in packing.py]."""
        T = x.size(1)
        pos = torch.arange(T, device=x.device)[None, :] if positions is None else positions
        if self.first:
            x = self._embed(x, pos)
        x = self._layers(x, pos, self._masks(pos, positions, x.dtype), None)
        return self._head(x, targets) if self.last else x

    def _masks(self, pos: torch.Tensor, positions: torch.Tensor | None,
               dtype: torch.dtype) -> Callable[[int | None], torch.Tensor | None]:
        """A layer's mask by its window: block-diagonal causal over packed rows, else causal
        (None where the attention kernel is causal itself)."""
        if positions is not None:
            return functools.partial(BlockCausal(positions).additive, dtype)
        keys = torch.arange(pos.size(-1), device=pos.device)
        return lambda window: None if window is None and self._causal_kernel \
            else _mask(pos, keys, window, dtype)

    @property
    def _causal_kernel(self) -> bool:
        """The attention takes no mask for a plain causal layer over whole rows: SDPA then
        runs its flash or memory-efficient kernel with is_causal, which an explicit mask rules
        out (eager attention needs the mask)."""
        return getattr(self.config, "_attn_implementation", "eager") in _CAUSAL_KERNELS

    # -- generation ------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> RowCache:
        self._need_whole("new_cache")
        if max_len > self.context_length:
            raise ValueError(f"a cache of {max_len} positions exceeds the model's context of "
                             f"{self.context_length}")
        c = self.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w = self.head.weight
        shape = (batch, heads, max_len, head_dim)
        make = lambda: torch.zeros(shape, device=w.device, dtype=cache_dtype(w))  # noqa: E731
        return RowCache({int(i): (make(), make()) for i in self.blocks})

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: RowCache, start: torch.Tensor,
                       rows: torch.Tensor | None = None, *,
                       last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (or values) of new tokens ``idx`` (B, T) written to cache ``rows`` (default
        all) from positions ``start`` (B,) on [Note: KV cache rows in gpt.py]; with ``last``
        (B,), only those of each row's token ``last`` (B, 1, V)."""
        self._need_whole("forward_cached")
        B, T = idx.shape
        cache.window = CacheWindow.of(rows, B, start, T, cache.max_len, idx.device)
        rows = torch.arange(B, device=idx.device) if rows is None else to_device(rows, idx.device)
        pos = cache_positions(start, T, cache.max_len, idx.device)
        cache.rows, cache.pos = rows, pos
        keys = torch.arange(cache.window.live, device=idx.device)  # [Note: live cache window]
        x = self._embed(idx, pos)
        x = self._layers(x, pos, lambda window: _mask(pos, keys, window, x.dtype), cache)
        return self._head(at_positions(x, last), None)

    def _need_whole(self, what: str) -> None:
        if not (self.first and self.last):
            raise ValueError(f"{what} needs the whole model: a one-stage split")

    @property
    def head(self) -> nn.Linear:
        return self.score if self.value_head else self.lm_head

    # -- the pieces ------------------------------------------------------------------------
    def _embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c = self.container
        if self.family == "gpt2":
            return c.drop(c.wte(idx) + c.wpe(pos))
        return c.embed_tokens(idx)

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, mask_for, cache) -> torch.Tensor:
        masks: dict[Any, torch.Tensor] = {}
        rotary = self._rotary[0]
        extra = {} if rotary is None else {"position_embeddings": rotary(x, pos),
                                           "position_ids": pos}
        for i, block in self.blocks.items():
            window = self._windows[int(i)]
            if window not in masks:
                masks[window] = mask_for(window)
            out = block(x, attention_mask=masks[window], use_cache=cache is not None,
                        **{self._cache_keyword: cache}, **extra)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def _head(self, x: torch.Tensor, targets: torch.Tensor | None):
        c = self.container
        out = self.head(c.ln_f(x) if self.family == "gpt2" else c.norm(x))
        if self.value_head:
            values = out.squeeze(-1)
            return values if targets is None else F.mse_loss(values, targets.to(values.dtype))
        if targets is None:
            return out
        return F.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1),
                               ignore_index=-1)


# attention implementations that make a layer causal themselves when given no mask
_CAUSAL_KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3")


def _context_length(config: Any) -> int:
    """The longest sequence the model runs: its position limit."""
    return int(getattr(config, "max_position_embeddings", None) or config.n_positions)


def _cache_keyword(block: nn.Module | None) -> str:
    """What a decoder layer calls its cache: `cache` in recent transformers 5 releases, which
    keep `past_key_values` as a deprecated alias, `past_key_values` before them."""
    if block is None:
        return "past_key_values"
    parameters = inspect.signature(block.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _window(config: Any, layer: int) -> int | None:
    """The sliding window of decoder layer `layer`, None for full attention."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        return window if types[layer] == "sliding_attention" else None
    return window if config.model_type == "mistral" else None


def _mask(pos: torch.Tensor, keys: torch.Tensor, window: int | None,
          dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (B, 1, T, L): a query at position p sees keys at positions <= p (and
    > p - window for a sliding layer)."""
    seen = keys[None, None, :] <= pos[:, :, None]
    if window is not None:
        seen &= keys[None, None, :] > pos[:, :, None] - window
    mask = torch.zeros(seen.shape, dtype=dtype, device=pos.device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min)[:, None]


class RowCache:
    """Per decoder layer, keys and values (batch, kv_heads, max_len, head_dim) of each cache
    row, written by position [Note: Hugging Face stages]; `forward_cached` sets `rows` and `pos`
    (B, T) before the layers run, and each layer's attention calls `update`."""

    def __init__(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers
        self.rows: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.window: CacheWindow | None = None

    @property
    def max_len(self) -> int:
        return next(iter(self.layers.values()))[0].size(2)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *_: Any, **__: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.layers[int(layer_idx)]
        r = self.rows[:, None]  # (B, 1) against pos (B, T)
        k[r, :, self.pos] = key_states.transpose(1, 2).to(k.dtype)
        v[r, :, self.pos] = value_states.transpose(1, 2).to(v.dtype)
        return self.window.read(k), self.window.read(v)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.max_len

    def grown(self, batch: int, max_len: int) -> RowCache:
        """A cache of `batch` rows of `max_len` positions (no fewer than this one's) holding
        this one's rows; this one is emptied as it goes, so the two are never whole at once."""
        layers = {}
        for i in list(self.layers):
            k, v = self.layers.pop(i)
            layers[i] = (_enlarged(k, batch, max_len), _enlarged(v, batch, max_len))
        return RowCache(layers)

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Positions [0, length) of row `src` into rows `dst` [Note: shared prompts in
        executors/torch/rollout/engine.py]."""
        rows = torch.tensor(dst, device=next(iter(self.layers.values()))[0].device)
        for k, v in self.layers.values():
            k[rows, :, :length] = k[src, :, :length]
            v[rows, :, :length] = v[src, :, :length]
