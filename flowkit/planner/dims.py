"""Per-layer FLOPs and activation memory of a transformer, from the Zero Bubble paper's Table 1.

s sequence length, b microbatch size, h hidden size, a attention heads. Per layer:
F = sbh(24h + 4s), B = sbh(24h + 8s), W = sbh * 24h FLOPs; M_B = sb(34h + 5as) activation
memory, of which M_W = 32sbh is what W still needs after B. `Costs.from_dims` and
`MemoryModel.from_dims` build on these.
"""

from __future__ import annotations

__all__ = ["layer_flops", "layer_memory"]


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def layer_flops(*, seq: int, micro_batch: int, hidden: int) -> tuple[float, float, float]:
    """FLOPs of F, B (input gradient) and W (weight gradient) for one layer and microbatch."""
    _positive(seq=seq, micro_batch=micro_batch, hidden=hidden)
    sbh = seq * micro_batch * hidden
    return (float(sbh * (24 * hidden + 4 * seq)), float(sbh * (24 * hidden + 8 * seq)),
            float(sbh * 24 * hidden))


def layer_memory(*, seq: int, micro_batch: int, hidden: int, heads: int,
                 attention_scores: bool = True) -> tuple[float, float]:
    """(M_B, M_W): one layer's activations of one microbatch in bytes (16-bit), and the part W
    needs after B. `attention_scores` False leaves out the 5as² of the softmax's scores and
    their dropout mask, which a fused (flash) attention never stores: M_B = 34sbh."""
    _positive(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads)
    sb = seq * micro_batch
    scores = 5 * heads * seq if attention_scores else 0
    return float(sb * (34 * hidden + scores)), float(32 * sb * hidden)
