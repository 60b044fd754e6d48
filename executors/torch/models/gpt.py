"""The built-in GPT, after nanoGPT's model.py: one readable file, names from GPT-2.

The design: [Note: gpt], [Note: GPT stage inputs], [Note: tied embedding across stages], [Note: KV
cache rows], [Note: generation and scoring interface] below.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from executors.torch.device import to_device
from executors.torch.models.packing import BlockCausal

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTStage",
    "KVCache",
    "CacheWindow",
    "cache_positions",
    "layers_per_stage",
    "split_gpt",
    "stage_names",
    "sum_tied_grads",
    "tied_parameters",
]


# [Note: gpt] `GPT(**config)` builds the whole model (the flows name it as
# ``build="executors.torch.models.gpt:GPT"``); `split_gpt(model, stages)` cuts it into pipeline
# stages balanced by estimated cost.
#
# [Note: GPT stage inputs] Stage 0 takes the token ids ``idx`` (B, T); inner stages take hidden
# states (B, T, C); the last stage takes ``(hidden, targets)`` with ``targets`` (B, T) token ids and
# returns the scalar loss. A one-stage split takes ``(idx, targets)``. The runtime cuts a batch (B,
# T+1) of tokens into ``idx = batch[:, :-1]`` for the first stage and ``targets = batch[:, 1:]`` for
# the last; `StageRunner` passes integer inputs through without gradients, so targets are just one
# more input of the last stage. (A value head's float returns are the one exception: the runner
# treats them as activations and computes a gradient for them that nobody reads.) Each microbatch's
# loss is its mean over tokens; a plain loop that accumulates gradients over the same microbatches
# sums the same losses. Packed rows add ``positions`` (B, T) as every stage's third input
# [Note: packed rows in packing.py].
#
# [Note: tied embedding across stages] The unsplit model ties ``lm_head.weight`` to ``wte.weight``.
# Stages in different processes cannot share a parameter, so a split with more than one stage gives
# the last stage its own copy. Same math as the unsplit model holds if, after every backward and
# before the optimizer step, each copy's gradient is replaced by the sum of both (an all-reduce over
# the pair named by `tied_parameters`; `sum_tied_grads` does it in one process): both copies then
# start equal, get equal gradients and equal optimizer updates, so they stay equal.
#
# [Note: KV cache rows] For generation only (under no_grad): `forward_cached(idx, cache, start,
# rows)` runs new tokens ``idx`` (B, T) of the cache rows ``rows`` whose first new token sits at
# position ``start`` (B,). Every row holds its own sequence from position 0, so rows of different
# lengths need no left padding: a row's position ids are ``start + arange(T)``, and a query at
# position p sees the cached keys at positions <= p of its row and nothing else. Right padding (a
# batch of prompts of different lengths) is harmless: the pads write keys past the row's real end,
# which no real query sees and the next real token overwrites. A row is reused for a new sequence by
# writing its prompt from start 0 (continuous batching). `new_cache(batch, max_len)` makes an empty
# one; with `context_length` (block_size) this is the cache protocol of [Note: generation and
# scoring interface] in executors/torch/rollout/lm.py, with its options: `grown` (a larger cache
# holding this one's rows), `last` (logits of one position a row) and `start` on the host.


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256  # bytes: the example corpora are byte-tokenized, nothing to download
    block_size: int = 128  # longest sequence; sizes the position table wpe
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 keeps pipeline runs bit-comparable with a plain loop
    bias: bool = True  # biases in Linears and LayerNorms, like GPT-2
    value_head: bool = False  # a critic: one value per position instead of next-token logits

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, packed: BlockCausal | None = None) -> torch.Tensor:
        """Causal over each row, or within each sequence of `packed` rows [Note: packed rows
        in packing.py]."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        if packed is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = packed.attend(q, k, v, dropout_p=p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))

    def forward_cached(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       rows: torch.Tensor, pos: torch.Tensor, window: CacheWindow
                       ) -> torch.Tensor:
        """``x`` (B, T, C) at positions ``pos`` (B, T) of cache rows ``rows`` (B): write their
        keys and values, attend over the row's cache up to the window's live positions [Note:
        KV cache rows]."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        r = rows[:, None]  # (B, 1) broadcasts against pos (B, T)
        k_cache[r, :, pos] = k.view(B, T, self.n_head, C // self.n_head).to(k_cache.dtype)
        v_cache[r, :, pos] = v.view(B, T, self.n_head, C // self.n_head).to(v_cache.dtype)
        keys, values = window.read(k_cache), window.read(v_cache)  # (B, nh, live, hs)
        seen = torch.arange(keys.size(2), device=x.device)[None, None, :] <= pos[:, :, None]
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen[:, None])
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, packed: BlockCausal | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), packed)
        return x + self.mlp(self.ln_2(x))

    def forward_cached(self, x, k_cache, v_cache, rows, pos, window) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.ln_1(x), k_cache, v_cache, rows, pos, window)
        return x + self.mlp(self.ln_2(x))


def cache_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of a KV cache made now for a model with this `weight`: autocast's where the
    forwards run under it (a bf16-precision model's fp32 weights: a bf16 cache, half the
    memory), else the weight's."""
    kind = weight.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


@dataclass(eq=False)
class KVCache:
    """Keys and values of each block for ``batch`` rows of up to ``max_len`` positions,
    preallocated; see [Note: KV cache rows]."""

    k: list[torch.Tensor]  # per block (batch, nh, max_len, hs)
    v: list[torch.Tensor]

    @classmethod
    def empty(cls, config: GPTConfig, batch: int, max_len: int, *, n_layer: int | None = None,
              device=None, dtype=torch.float32) -> KVCache:
        if max_len > config.block_size:
            raise ValueError(f"a cache of {max_len} positions exceeds block_size "
                             f"{config.block_size}")
        shape = (batch, config.n_head, max_len, config.n_embd // config.n_head)
        layers = config.n_layer if n_layer is None else n_layer
        make = lambda: torch.zeros(shape, device=device, dtype=dtype)  # noqa: E731
        return cls(k=[make() for _ in range(layers)], v=[make() for _ in range(layers)])

    @property
    def max_len(self) -> int:
        return self.k[0].size(2)

    def grown(self, batch: int, max_len: int) -> KVCache:
        """A cache of `batch` rows of `max_len` positions (no fewer than this one's) holding
        this one's rows; this one is emptied as it goes, so the two are never whole at once."""
        k, v = [], []
        while self.k:
            k.append(_enlarged(self.k.pop(0), batch, max_len))
            v.append(_enlarged(self.v.pop(0), batch, max_len))
        return KVCache(k=k, v=v)

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Positions [0, length) of row `src` into rows `dst` [Note: shared prompts in
        executors/torch/rollout/engine.py]."""
        rows = torch.tensor(dst, device=self.k[0].device)
        for t in (*self.k, *self.v):
            t[rows, :, :length] = t[src, :, :length]


class GPT(nn.Module):
    """``GPT(GPTConfig(...))`` or ``GPT(**config)``; ``forward(idx, targets=None)``."""

    def __init__(self, config: GPTConfig | None = None, **overrides) -> None:
        super().__init__()
        config = GPTConfig(**{**(asdict(config) if config else {}), **overrides})
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        out = 1 if config.value_head else config.vocab_size
        self.lm_head = nn.Linear(config.n_embd, out, bias=False)
        if not config.value_head:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: residual projections scaled by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def split(self, stages: int, *, seq_len: int | None = None) -> list[nn.Module]:
        """Pipeline stages (the torch executor calls this): see `split_gpt`."""
        return split_gpt(self, stages, seq_len=seq_len)

    def stage_names(self, stages: int, *, seq_len: int | None = None) -> list[dict[str, str]]:
        """Per stage of `split(stages, seq_len=...)`, its parameter names -> this model's
        (executors/torch/weights.py moves weights between splits by them): see `stage_names`."""
        return stage_names(self.config, stages, seq_len=seq_len)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """Logits, values or the loss of rows `idx` (B, T); with `positions` (B, T), of
        packed rows [Note: packed rows in packing.py]."""
        x = _embed(self.transformer, idx, positions)  # (B, T, C)
        packed = None if positions is None else BlockCausal(positions)
        for block in self.transformer.h:
            x = block(x, packed)
        return _head(self.config, self.transformer.ln_f, self.lm_head, x, targets)

    @property
    def context_length(self) -> int:
        """The longest sequence it runs: the position table's size."""
        return self.config.block_size

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache of ``batch`` rows of ``max_len`` positions, where the weights are,
        in the dtype the forwards compute in [Note: KV cache rows]."""
        w = self.lm_head.weight
        return KVCache.empty(self.config, batch, max_len, device=w.device, dtype=cache_dtype(w))

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: KVCache, start: torch.Tensor,
                       rows: torch.Tensor | None = None, *,
                       last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (or values) of new tokens ``idx`` (B, T) written to cache ``rows`` (default
        all) from positions ``start`` (B,) on [Note: KV cache rows]; with ``last`` (B,), only
        those of each row's token ``last`` (B, 1, V)."""
        t = self.transformer
        return _forward_cached(self.config, t, t.h, t.ln_f, self.lm_head, idx, cache, start, rows,
                               last)


def _embed(transformer: nn.ModuleDict, idx: torch.Tensor,
           positions: torch.Tensor | None = None) -> torch.Tensor:
    """Token plus position embeddings of ``idx`` (B, T) -> (B, T, C), at `positions` (B, T)
    where given (packed rows), else 0 … T-1."""
    T = idx.size(1)
    block_size = transformer.wpe.num_embeddings
    if T > block_size:
        raise ValueError(f"cannot forward a sequence of length {T}; block_size is {block_size}")
    pos = torch.arange(T, dtype=torch.long, device=idx.device) if positions is None else positions
    return transformer.drop(transformer.wte(idx) + transformer.wpe(pos))


def _forward_cached(config, embed, blocks, ln_f, lm_head, idx, cache, start, rows, last=None):
    """The cached forward of a whole model (`GPT`, or a `GPTStage` both first and last)."""
    B, T = idx.shape
    window = CacheWindow.of(rows, B, start, T, cache.max_len, idx.device)
    rows = torch.arange(B, device=idx.device) if rows is None else to_device(rows, idx.device)
    pos = cache_positions(start, T, cache.max_len, idx.device)  # (B, T)
    x = embed.drop(embed.wte(idx) + embed.wpe(pos))  # (B, T, C)
    for i, block in enumerate(blocks):
        x = block.forward_cached(x, cache.k[i], cache.v[i], rows, pos, window)
    return _head(config, ln_f, lm_head, at_positions(x, last), None)


# [Note: live cache window] A cached forward reads each row's keys and values only up to the
# batch's last live position (`live`, from `start` on the host) rather than the cache's whole
# length, and, when its rows are the cache's first B in order (a full continuous batch, every
# prefill of a fresh cache), as a view of them instead of a gathered copy: attention and the
# copy then cost what the sequences hold, not what the cache was sized for (a cache doubles as
# it grows: up to twice the positions; on a GPU a gather of a long cache every decode step is
# the engine's largest memory traffic). Positions past `live` are masked anyway, so the logits
# equal the whole-cache forward's to rounding (tests/torch/test_engine_memory.py).
@dataclass(frozen=True)
class CacheWindow:
    """Which cache rows (a slice of the first B, or a row tensor) and positions a cached
    forward reads [Note: live cache window]."""

    rows: slice | torch.Tensor
    live: int

    @classmethod
    def of(cls, rows: torch.Tensor | None, batch: int, start: torch.Tensor, T: int,
           max_len: int, device: torch.device) -> CacheWindow:
        """The window of a forward of T tokens a row from `start` (B,) into `rows` (None: the
        first `batch`) of a cache on `device`; rows given on the host are read as a slice when
        they are 0 .. B-1."""
        live = min(max_len, int(start.max()) + T)
        if rows is None or (rows.device.type == "cpu" and rows.tolist() == list(range(batch))):
            return cls(slice(0, batch), live)
        return cls(to_device(rows, device), live)

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """(B, heads, live, head_dim) of a layer's keys or values (batch, heads, max_len, hd)."""
        return cache[self.rows, :, :self.live]


def cache_positions(start: torch.Tensor, T: int, max_len: int,
                    device: torch.device) -> torch.Tensor:
    """Positions (B, T) on `device` of T new tokens a row whose first sits at `start` (B,); one
    past a cache of `max_len` positions is an error, checked where `start` is: given on the
    host, without waiting for the device ([Note: transfers without a wait] in device.py)."""
    end = int(start.max()) + T - 1
    if end >= max_len:
        raise ValueError(f"position {end} is past the cache's {max_len}")
    return to_device(start, device)[:, None] + torch.arange(T, device=device)[None, :]


def at_positions(x: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """Hidden states ``x`` (B, T, C) of the token ``last`` (B,) of each row (B, 1, C), or all of
    them without `last`: a prefill's head runs on the one position it reads."""
    if last is None:
        return x
    rows = torch.arange(x.size(0), device=x.device)
    return x[rows, to_device(last, x.device)][:, None]


def _enlarged(t: torch.Tensor, batch: int, max_len: int) -> torch.Tensor:
    """Cache tensor ``t`` (rows, heads, positions, head size) copied into the first rows and
    positions of a zeroed one of `batch` rows and `max_len` positions."""
    out = t.new_zeros((max(batch, t.size(0)), t.size(1), max(max_len, t.size(2)), t.size(3)))
    out[:t.size(0), :, :t.size(2)] = t
    return out


def _head(config: GPTConfig, ln_f: nn.Module, lm_head: nn.Module, x, targets):
    """Logits (B, T, vocab) or values (B, T); with targets, the mean loss instead: cross-entropy
    on next tokens, or for a value head the squared error against float returns."""
    out = lm_head(ln_f(x))  # (B, T, vocab) or (B, T, 1)
    if config.value_head:
        values = out.squeeze(-1)  # (B, T)
        return values if targets is None else F.mse_loss(values, targets.to(values.dtype))
    if targets is None:
        return out
    # target -1 masks a position (padding, or a prompt in SFT), as in nanoGPT
    return F.cross_entropy(out.view(-1, out.size(-1)), targets.reshape(-1), ignore_index=-1)


# -- pipeline stages -------------------------------------------------------------------------
class GPTStage(nn.Module):
    """A contiguous slice of a GPT: embeddings if first, blocks, and ln_f + head if last.
    Inputs per position: see [Note: GPT stage inputs]."""

    def __init__(self, config: GPTConfig, blocks: list[Block], *, first: bool, last: bool,
                 transformer: nn.ModuleDict, lm_head: nn.Linear) -> None:
        super().__init__()
        self.config, self.first, self.last = config, first, last
        self.h = nn.ModuleList(blocks)
        if first:
            self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop
        if last:
            self.ln_f, self.lm_head = transformer.ln_f, lm_head

    def tied_copies(self) -> tuple[str, ...]:
        """Names of this stage's parameters that are copies of one weight of the unsplit
        model held by another stage [Note: tied embedding across stages]."""
        if self.first == self.last or self.config.value_head:
            return ()
        return ("wte.weight",) if self.first else ("lm_head.weight",)

    def tied_pairs(self) -> dict[str, str]:
        """On the last stage: the first stage's tied parameter -> this stage's copy."""
        return {"wte.weight": "lm_head.weight"} if self.tied_copies() and self.last else {}

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        if self.first:
            x = _embed(self, x, positions)  # (B, T) ids -> (B, T, C)
        packed = None if positions is None else BlockCausal(positions)
        for block in self.h:
            x = block(x, packed)
        if self.last:
            return _head(self.config, self.ln_f, self.lm_head, x, targets)
        return x

    @property
    def context_length(self) -> int:
        return self.config.block_size

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """`GPT.new_cache`, for a stage that is the whole model (a one-stage split)."""
        self._need_whole("new_cache")
        w = self.lm_head.weight
        return KVCache.empty(self.config, batch, max_len, device=w.device, dtype=cache_dtype(w))

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: KVCache, start: torch.Tensor,
                       rows: torch.Tensor | None = None, *,
                       last: torch.Tensor | None = None) -> torch.Tensor:
        """`GPT.forward_cached`, for a stage that is the whole model (a one-stage split)."""
        self._need_whole("forward_cached")
        return _forward_cached(self.config, self, self.h, self.ln_f, self.lm_head, idx, cache,
                               start, rows, last)

    def _need_whole(self, what: str) -> None:
        if not (self.first and self.last):
            raise ValueError(f"{what} needs the whole model: a one-stage split")


def layers_per_stage(config: GPTConfig, stages: int, *, seq_len: int | None = None) -> list[int]:
    """Blocks per stage minimizing the most expensive stage, by forward FLOPs per token: a
    block costs 24C² + 4TC (projections, attention scores), the head 2CV plus the loss, and
    the embeddings a little on the first stage."""
    if not 1 <= stages <= config.n_layer:
        raise ValueError(f"a GPT of {config.n_layer} layers splits into 1 to {config.n_layer} "
                         f"pipeline stages, not {stages}: use --stages {config.n_layer} or "
                         "fewer, or a deeper model (n_layer)")
    C, T = config.n_embd, seq_len or config.block_size
    block = 24 * C * C + 4 * T * C
    head_cost = 2 * C * (1 if config.value_head else config.vocab_size) + 4 * C
    extra = [0.0] * stages
    extra[0] += 4 * C  # embedding lookups and the add
    extra[-1] += head_cost
    return _balanced(config.n_layer, block, extra)


def _balanced(n: int, block: float, extra: list[float]) -> list[int]:
    """Split n equal blocks into len(extra) contiguous non-empty parts: first the smallest
    possible most expensive part (cost k * block + extra[s]), then, under that bound, the most
    even parts (least sum of squared costs), so a heavy head does not pile blocks elsewhere."""
    p = len(extra)
    limits = sorted({k * block + e for k in range(1, n + 1) for e in extra})
    for limit in limits:
        caps = [min(n, int((limit - e) / block + 1e-9)) for e in extra]
        if min(caps) >= 1 and sum(caps) >= n:
            break
    # best[used] = (sum of squares, counts) over the stages placed so far
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for s in range(p):
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (sq, counts) in best.items():
            for k in range(1, min(caps[s], n - used - (p - s - 1)) + 1):
                cand = (sq + (k * block + extra[s]) ** 2, counts + (k,))
                if used + k not in nxt or cand[0] < nxt[used + k][0]:
                    nxt[used + k] = cand
        best = nxt
    return list(best[n][1])


def split_gpt(model: GPT, stages: int, *, seq_len: int | None = None) -> list[nn.Module]:
    """Cut `model` into `stages` stage modules (sharing its parameters, except the last
    stage's untied copy of the head; see [Note: tied embedding across stages])."""
    config = model.config
    counts = layers_per_stage(config, stages, seq_len=seq_len)
    lm_head = model.lm_head
    if stages > 1 and not config.value_head:
        lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        lm_head = lm_head.to(device=model.lm_head.weight.device, dtype=model.lm_head.weight.dtype)
        with torch.no_grad():
            lm_head.weight.copy_(model.lm_head.weight)
    blocks = list(model.transformer.h)
    out, start = [], 0
    for s, k in enumerate(counts):
        out.append(GPTStage(config, blocks[start : start + k], first=s == 0,
                            last=s == stages - 1, transformer=model.transformer, lm_head=lm_head))
        start += k
    return out


def stage_names(config: GPTConfig, stages: int, *,
                seq_len: int | None = None) -> list[dict[str, str]]:
    """Per stage of ``split_gpt(model, stages, seq_len=seq_len)``: each of its parameter names
    (every name, a one-stage split's tied ``lm_head.weight`` beside its ``wte.weight``) -> the
    unsplit GPT's name for the same weight: ``h.{i}.*`` -> ``transformer.h.{first + i}.*``,
    ``wte``/``wpe``/``ln_f`` -> ``transformer.*``, ``lm_head.weight`` -> ``lm_head.weight`` (the
    last stage's untied copy too [Note: tied embedding across stages])."""
    counts = layers_per_stage(config, stages, seq_len=seq_len)
    with torch.device("meta"):  # names only: nothing allocated
        block = [name for name, _ in Block(config).named_parameters()]
        norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        ln_f = [name for name, _ in norm.named_parameters()]
    out, start = [], 0
    for s, k in enumerate(counts):
        names = {}
        if s == 0:
            names |= {f"{n}.weight": f"transformer.{n}.weight" for n in ("wte", "wpe")}
        names |= {f"h.{i}.{b}": f"transformer.h.{start + i}.{b}" for i in range(k) for b in block}
        if s == stages - 1:
            names |= {f"ln_f.{n}": f"transformer.ln_f.{n}" for n in ln_f}
            names["lm_head.weight"] = "lm_head.weight"
        out.append(names)
        start += k
    return out


def tied_parameters(stages: list[nn.Module]) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """Pairs ((stage, name), (stage, name)) of parameters that are one weight in the unsplit
    model but separate copies here; their gradients must be summed before each step."""
    if len(stages) < 2 or stages[0].config.value_head:
        return []
    return [((0, "wte.weight"), (len(stages) - 1, "lm_head.weight"))]


def sum_tied_grads(stages: list[nn.Module]) -> None:
    """In one process: give both copies of every tied pair the sum of their gradients."""
    for (sa, na), (sb, nb) in tied_parameters(stages):
        a, b = stages[sa].get_parameter(na), stages[sb].get_parameter(nb)
        total = sum(g for g in (a.grad, b.grad) if g is not None)
        if isinstance(total, torch.Tensor):
            a.grad, b.grad = total.clone(), total.clone()
