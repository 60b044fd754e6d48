"""Vectorized, reproducible token sampling for the rollout engine: one call samples a whole batch
of rows (B, V), each with its own temperature, top-p, seed and position.

The design: [Note: sampling], [Note: inverse-CDF order], [Note: counter-based sampling], [Note:
chunked log-probabilities] below.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from executors.torch.device import to_device

__all__ = ["sample_tokens", "sequence_seed", "token_logprobs", "uniforms"]


# [Note: sampling] The log-probabilities follow [Note: sampler log-probabilities]
# (executors/torch/rollout/generate.py): ``log_softmax(logits / temperature)[token]`` over the whole
# vocabulary in float64, before top-p truncation; greedy rows (``temperature <= 0``) take the argmax
# and record ``log_softmax(logits)``. The top-p set is the one `generate._top_p` keeps, computed for
# all rows at once.
#
# [Note: inverse-CDF order] A row draws the first token whose cumulative probability exceeds its
# uniform u times the total. Rows with top_p >= 1 accumulate in vocabulary order: no sort, which
# dominates the cost at a large vocabulary. Top-p rows accumulate their kept set in descending
# probability, ties ranked by token id (a stable sort), so which of two tied tokens stays in the set
# is defined on every device. Either way the token is a function of the row alone: its logits,
# temperature, top_p, seed and position.
#
# [Note: counter-based sampling] The uniform a row draws is a pure function of (seed, position):
# ``seed`` is the sequence's 64-bit seed (`sequence_seed`), ``position`` the index of the token in
# the response (0 for the first response token). Nothing is carried from one call to the next, so a
# sequence draws the same uniforms whatever else is in the batch, in whichever row, for any arrival
# order or max_batch, and a sequence paused and resumed at position p draws exactly what it would
# have drawn at p. The uniform is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
# 1, 2, 3", SC'11; the generator behind torch's and cuRAND's CUDA randomness): key = the seed's two
# 32-bit halves, counter = (position's two 32-bit halves, 0, 0), and 53 bits of its first two output
# words make a float64 in [0, 1). Philox passes TestU01's BigCrush for every key, and distinct (key,
# counter) pairs give independent-looking outputs, so different seeds and positions never share a
# stream. It runs in torch int64 arithmetic with every intermediate below 2^63 (`_mulhilo`
# splits the 32x32-bit products): no signed overflow (undefined in C++), the same bits on CPU and
# CUDA. Known-answer vectors from Random123 pin it in tests/torch/test_sampling.py.
#
# [Note: chunked log-probabilities] Scoring reads one log-probability a position, but its
# log-softmax spans the vocabulary: a 4,096-token forward's all at once in float64 is 4,096 x 152k
# x 8 bytes = 5 GB. `token_logprobs` takes a chunk of positions at a time (_CHUNK_ELEMENTS logits,
# 64 MiB in float32) in the logits' precision, at least float32: a float64 model's log-probs stay
# exactly float64's (the path the equality tests compare), a bf16 or float32 model's are float32's.
# The kernel normalises each position alone, so a chunk changes no bit of it and scores stay
# batch-invariant. The sampler keeps float64, in which its draws are defined, and bounds its
# memory by rows instead: `sample_tokens` takes _CHUNK_ELEMENTS logits' worth of rows at a time.

_MASK32 = 0xFFFF_FFFF
_MASK64 = 0xFFFF_FFFF_FFFF_FFFF
_PHILOX_M = (0xD251_1F53, 0xCD9E_8D57)  # round multipliers of Philox4x32 (Random123)
_PHILOX_W = (0x9E37_79B9, 0xBB67_AE85)  # key schedule increments (golden ratio, sqrt(3) - 1)
_CANDIDATES = 1024  # a top-p row sorts only this many likeliest tokens when they hold its set
_PHILOX_ROUNDS = 10  # Random123's default; 7 already passes BigCrush, 10 is its safety margin
_CHUNK_ELEMENTS = 1 << 24  # logits a log-softmax takes at once [Note: chunked log-probabilities]


# -- the batch sampler ------------------------------------------------------------------------
def sample_tokens(logits: torch.Tensor, *, temperature: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, positions: torch.Tensor,
                  top_k: torch.Tensor | None = None, entropy: bool = False) -> tuple:
    """One token per row of ``logits`` (B, V) and its log-probability [Note: sampler
    log-probabilities]: tokens (B,) int64, logprobs (B,) float64. Each row has its own
    temperature (0: greedy), top_p, top_k (0 or None: every token; the top-p set is taken
    within the top k, as vLLM takes it), seed and position [Note: counter-based sampling]; any
    dtype of logits, computed in float64 on their device, a chunk of rows at a time [Note:
    chunked log-probabilities]. Settings given on the CPU cost no host synchronization; given
    on the GPU, one a chunk (which rows need top-p). With `entropy`, a third tensor: each
    row's entropy in nats (B,) float64, of the distribution at its temperature over the whole
    vocabulary (greedy rows: at temperature 1) [Note: entropy branching in branching.py]."""
    top_k = torch.zeros(len(logits), dtype=torch.int64) if top_k is None else top_k
    settings, nucleus, limited = _rows(logits, temperature, top_p, seeds, positions, top_k)
    rows = max(1, _CHUNK_ELEMENTS // max(1, logits.size(-1)))
    parts = [_sample_chunk(logits[i:i + rows], [s[i:i + rows] for s in settings],
                           nucleus[i:i + rows], limited[i:i + rows], entropy)
             for i in range(0, max(1, len(logits)), rows)]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))


def _sample_chunk(logits: torch.Tensor, settings: list[torch.Tensor], nucleus: torch.Tensor,
                  limited: torch.Tensor, entropy: bool = False) -> tuple:
    """`sample_tokens` of some rows: their settings on the logits' device, which of them
    sample from a top-p set (bool, where the settings were given) and which from a top-k set
    (bool, on the host)."""
    x = logits.to(torch.float64)  # (B, V)
    temperature, top_p, seeds, positions, top_k = settings
    nucleus = to_device(torch.nonzero(nucleus)[:, 0], x.device)
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = F.log_softmax(x / t[:, None], dim=-1)  # (B, V); greedy rows at temperature 1
    probs = logp.exp()
    spread = torch.special.entr(probs).sum(dim=-1) if entropy else None  # before any top-k
    if bool(limited.any()):  # the log-probs stay the whole vocabulary's [Note: sampling]
        probs = _top_k(probs, top_k, to_device(torch.nonzero(limited)[:, 0], x.device))
    u = uniforms(seeds, positions)  # (B,)
    sampled = _inverse_cdf(probs, u)  # [Note: inverse-CDF order]
    if len(nucleus):  # only top-p rows pay for a sort
        sampled[nucleus] = _top_p_draw(probs[nucleus], top_p[nucleus], u[nucleus])
    tokens = torch.where(greedy, torch.argmax(x, dim=-1), sampled)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return (tokens, chosen) if spread is None else (tokens, chosen, spread)


def _top_k(probs: torch.Tensor, top_k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`probs` with each of `rows` keeping its `top_k` most likely tokens (ties at the k-th
    kept too: the set is a function of the row's probabilities alone), renormalized, so that
    a top-p set within it is taken of its mass; the other rows as they are."""
    chosen = probs[rows]
    k = top_k[rows].clamp(max=probs.shape[-1])
    kth = torch.topk(chosen, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    chosen = chosen.masked_fill(chosen < kth, 0.0)
    out = probs.clone()
    out[rows] = chosen / chosen.sum(dim=-1, keepdim=True)
    return out


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` (B, V) (unnormalized, >= 0, some positive), the first index whose
    cumulative weight exceeds u * total: index i with probability weights[i] / total. A zero
    weight is a flat step of the cdf, never chosen; u * total may round up to total itself
    (probability ~2^-53), and then it is the last index with weight."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:].contiguous()
    index = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)  # where the cdf reaches its total
    return torch.minimum(index, last)[:, 0]


def _top_p_draw(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens (n,) drawn with uniforms u (n,) from the top-p sets of probs (n, V). A row sorts
    only its `_CANDIDATES` most likely tokens when they hold the whole set: every token of the
    set is then strictly likelier than the least likely candidate, so the candidates sorted by
    (probability, token id) start exactly as the whole vocabulary sorted so, and the draw is
    the same as the full sort's. Other rows sort everything."""
    tokens = torch.empty(len(probs), dtype=torch.int64, device=probs.device)
    rest = torch.arange(len(probs), device=probs.device)
    if _CANDIDATES < probs.shape[1]:
        top, ids = torch.topk(probs, _CANDIDATES, dim=-1, sorted=False)
        ids = torch.sort(ids, dim=-1).values  # token order: the stable sort ranks ties by id
        cand = probs.gather(1, ids)
        kept, order = _nucleus(cand, top_p)
        floor = top.min(dim=-1, keepdim=True).values  # (n, 1): the least likely candidate
        first_tie = (cand > floor).sum(dim=-1, keepdim=True)  # rank of its first equal
        # the set stops before first_tie (masked there and floor > 0: not a kept zero)
        whole = (kept.gather(1, first_tie) == 0) & (floor > 0)  # (n, 1)
        tokens = ids.gather(1, order.gather(1, _inverse_cdf(kept, u)[:, None]))[:, 0]
        rest = torch.nonzero(~whole[:, 0])[:, 0]  # on CUDA, the one synchronization
    if len(rest):
        kept, order = _nucleus(probs[rest], top_p[rest])
        tokens[rest] = order.gather(1, _inverse_cdf(kept, u[rest])[:, None])[:, 0]
    return tokens


def _rows(x: torch.Tensor, temperature, top_p, seeds, positions, top_k
          ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The per-row settings as (B,) tensors on the logits' device, shape errors all at once, and
    which rows sample from a top-p set (sampling, top_p < 1) and from a top-k set (sampling,
    top_k > 0): masks where top_p and top_k lie."""
    if x.dim() != 2:
        raise ValueError(f"sample_tokens: logits must be (B, V), got shape {tuple(x.shape)}")
    b = x.shape[0]
    given, errors = [], []
    for name, value, dtype in (("temperature", temperature, torch.float64),
                               ("top_p", top_p, torch.float64),
                               ("seeds", seeds, torch.int64),
                               ("positions", positions, torch.int64),
                               ("top_k", top_k, torch.int64)):
        value = torch.as_tensor(value).to(dtype)
        if value.shape != (b,):
            errors.append(f"{name} must be ({b},) like the logits' rows, got {tuple(value.shape)}")
        given.append(value)
    if errors:
        raise ValueError(f"sample_tokens: {len(errors)} errors: " + "; ".join(errors))
    temperature, top_p, top_k = given[0], given[1], given[4]
    nucleus = (top_p < 1.0) & (temperature.to(top_p.device) > 0)
    limited = (top_k > 0) & (temperature.to(top_k.device) > 0)
    return [to_device(v, x.device) for v in given], nucleus, limited


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest set of most likely tokens whose mass reaches top_p (always the top
    one) — the set `generate._top_p` keeps: (probabilities sorted descending with the rest
    zeroed, the sort order), both (B, V). top_p >= 1 keeps every token."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above
    keep = (before < top_p[:, None]) | (top_p >= 1.0)[:, None]
    keep[:, 0] = True
    return sorted_p.masked_fill(~keep, 0.0), order


# -- scoring ----------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                   dtype: torch.dtype | None = None, chunk: int | None = None) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` at each position of logits (B, T, V) or
    (T, V) and tokens (B, T) or (T,): float64, computed `chunk` positions at a time in `dtype`
    (the logits' own, at least float32) [Note: chunked log-probabilities]."""
    if logits.dim() == 2:
        return token_logprobs(logits[None], tokens[None], temperature=temperature, dtype=dtype,
                              chunk=chunk)[0]
    dtype = dtype or torch.promote_types(logits.dtype, torch.float32)
    B, T, V = logits.shape
    chunk = max(1, chunk or _CHUNK_ELEMENTS // V)  # positions a step
    rows, width = max(1, chunk // T), min(T, chunk)  # whole rows, or pieces of one
    out = torch.empty((B, T), dtype=torch.float64, device=logits.device)
    for b in range(0, B, rows):
        for t in range(0, T, width):
            x = logits[b:b + rows, t:t + width].to(dtype) / temperature
            picked = tokens[b:b + rows, t:t + width, None].to(x.device)
            out[b:b + rows, t:t + width] = F.log_softmax(x, dim=-1).gather(-1, picked)[..., 0]
    return out


# -- counter-based uniforms -------------------------------------------------------------------
def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B,) float64 in [0, 1), a pure function of each (seed, position) pair of int64s
    [Note: counter-based sampling]: Philox4x32-10, then 53 bits of its first two words."""
    seeds, positions = torch.broadcast_tensors(seeds.to(torch.int64), positions.to(torch.int64))
    if seeds.device.type == "cpu":
        return torch.from_numpy(_host_uniforms(seeds.numpy(), positions.numpy()))
    key = torch.stack([seeds & _MASK32, (seeds >> 32) & _MASK32])  # (2, B); >> is arithmetic:
    zero = torch.zeros_like(positions)  # the mask keeps the two's-complement bits of negatives
    counter = torch.stack([positions & _MASK32, (positions >> 32) & _MASK32, zero, zero])
    out = _philox4x32(counter, key)  # (4, B) words in [0, 2^32)
    bits53 = (out[0] >> 5) * (1 << 26) + (out[1] >> 6)  # 27 + 26 bits, < 2^53: exact in float64
    return bits53.to(torch.float64) * 2.0**-53


def _host_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`uniforms` on the host, the same bits: the rounds in numpy's uint64, whose product of two
    32-bit words is exact, so no 16-bit split; a few microseconds an operation instead of
    torch's tens (the sampler runs it every decode step: 2.5 % of an executor's time in the
    README's GRPO step, py-spy of `flowkit run examples/qwen2_grpo.py --stages 1 -n 1`)."""
    s, p = seeds.astype(np.uint64), positions.astype(np.uint64)  # two's complement bits
    mask = np.uint64(_MASK32)
    k0, k1 = s & mask, s >> np.uint64(32)
    c0, c1 = p & mask, p >> np.uint64(32)
    c2 = c3 = np.zeros_like(c0)
    m0, m1 = np.uint64(_PHILOX_M[0]), np.uint64(_PHILOX_M[1])
    w0, w1 = np.uint64(_PHILOX_W[0]), np.uint64(_PHILOX_W[1])
    for r in range(_PHILOX_ROUNDS):
        if r > 0:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask)
    bits53 = (c0 >> np.uint64(5)) * np.uint64(1 << 26) + (c1 >> np.uint64(6))
    return bits53.astype(np.float64) * 2.0**-53


def _philox4x32(counter: torch.Tensor, key: torch.Tensor,
                rounds: int = _PHILOX_ROUNDS) -> torch.Tensor:
    """Philox4x32-R of counters (4, B) under keys (2, B), as Random123's philox4x32_R: all words
    int64 in [0, 2^32). Round r > 0 first bumps the key by the Weyl increments."""
    device = counter.device
    m = to_device(torch.tensor(_PHILOX_M, dtype=torch.int64), device)[:, None]  # (2, 1)
    w = to_device(torch.tensor(_PHILOX_W, dtype=torch.int64), device)[:, None]
    for r in range(rounds):
        if r > 0:
            key = (key + w) & _MASK32
        hi, lo = _mulhilo(counter[0::2], m)  # (2, B): M0 * c0 and M1 * c2
        mixed = hi.flip(0) ^ counter[1::2] ^ key  # hi1 ^ c1 ^ k0, hi0 ^ c3 ^ k1
        counter = torch.stack([mixed, lo.flip(0)], dim=1).reshape(4, -1)  # x0, lo1, x1, lo0
    return counter


def _mulhilo(a: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of a * m for a, m in [0, 2^32), never above 2^63: m splits
    into 16-bit halves, a * m = (a * m_hi) * 2^16 + a * m_lo with both products < 2^48."""
    p_lo = a * (m & 0xFFFF)  # < 2^48
    p_hi = a * (m >> 16)  # < 2^48
    t = ((p_hi & 0xFFFF) << 16) + p_lo  # < 2^49; a * m = (p_hi >> 16) * 2^32 + t
    return (p_hi >> 16) + (t >> 32), t & _MASK32


# -- per-sequence seeds -----------------------------------------------------------------------
def sequence_seed(seed: int, prompt_id: int, sample: int, *, step: int = 0) -> int:
    """The 63-bit seed of one sequence of a run [Note: counter-based sampling]: (seed, step,
    prompt_id, sample), each taken mod 2^64, folded through splitmix64 (Steele et al., 2014)
    in Python integer arithmetic — the same value in every process, platform and Python version,
    unlike str hashes (salted per process) or tuple hashes (an implementation detail)."""
    h = 0
    for part in (seed, step, prompt_id, sample):
        h = _splitmix64(h ^ (int(part) & _MASK64))  # a bijection of h for each fixed part
    return h >> 1


def _splitmix64(x: int) -> int:
    """One splitmix64 output for state x: a bijection of 64-bit integers."""
    z = (x + 0x9E37_79B9_7F4A_7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return z ^ (z >> 31)
