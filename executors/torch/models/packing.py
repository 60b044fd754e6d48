"""Packed rows: several sequences in one row of a batch, each with its own positions, attending
only within itself. `pack` lays sequences out in rows; `BlockCausal` is the attention over such
rows, which the built-in GPT and the Hugging Face stages take.

[Note: packed rows] A model with `packing` runs a microbatch (or a scoring forward) as rows of
the width of its longest sequence, filled first-fit by decreasing length, instead of one row per
sequence padded to the longest: padding falls from most of a long-tailed batch's tokens to a
few. A row's layout travels as `positions` (R, W): each sequence's positions from 0, and the
pad run after a row's last sequence numbered from 0 too, so a position 0 starts a segment.
Attention is block-diagonal causal (a query sees the keys of its own segment at or before it),
so each sequence's outputs are those of its padded row: the losses, gradients, log-probs and
values equal the padded path's (float64 tests, tests/torch/test_packing.py). Only a layout
with a row of two or more sequences is packed; otherwise the rows go as before, causal.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

__all__ = ["BlockCausal", "Packing", "accepts_positions", "pack", "packed_rows", "varlen_kernel"]


@attrs.frozen
class Packing:
    """Where each sequence sits: `places[i]` = (row, offset) of sequence i, of `lengths[i]`
    tokens, in `rows` rows of `width` [Note: packed rows]."""

    width: int
    rows: int
    places: tuple[tuple[int, int], ...]
    lengths: tuple[int, ...]

    @property
    def packed(self) -> bool:
        """Whether some row holds two sequences or more (else the padded rows are as good)."""
        starts = [row for (row, _), n in zip(self.places, self.lengths) if n]
        return len(starts) != len(set(starts))

    def tokens(self, seqs: Sequence[Sequence[int]], device: torch.device,
               fill: int = 0) -> torch.Tensor:
        """`seqs` (each of its length) laid out as (rows, width), `fill` elsewhere."""
        out = [[fill] * self.width for _ in range(self.rows)]
        for (row, offset), seq, n in zip(self.places, seqs, self.lengths):
            out[row][offset:offset + n] = list(seq)[:n]
        return torch.tensor(out, dtype=torch.long, device=device).reshape(self.rows, self.width)

    def positions(self, device: torch.device) -> torch.Tensor:
        """(rows, width): each sequence's positions from 0, each row's pad run from 0."""
        out = [list(range(self.width)) for _ in range(self.rows)]
        ends = [0] * self.rows
        for (row, offset), n in sorted(zip(self.places, self.lengths)):
            out[row][offset:offset + n] = range(n)
            ends[row] = max(ends[row], offset + n)
        for row, end in enumerate(ends):
            out[row][end:] = range(self.width - end)
        return torch.tensor(out, dtype=torch.long, device=device).reshape(self.rows, self.width)


def pack(lengths: Sequence[int], width: int | None = None) -> Packing:
    """Rows of `width` (default: the longest length, at least 1) holding sequences of
    `lengths`, first-fit by decreasing length (ties in order; an empty sequence takes no room
    and sits at (0, 0)); where no row would hold two, one row each in order, as padded."""
    lengths = tuple(int(n) for n in lengths)
    width = max([*lengths, 1]) if width is None else int(width)
    if lengths and max(lengths) > width:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit rows of {width}")
    fill: list[int] = []
    places = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if not lengths[i]:
            continue
        row = next((r for r, used in enumerate(fill) if used + lengths[i] <= width), len(fill))
        if row == len(fill):
            fill.append(0)
        places[i] = (row, fill[row])
        fill[row] += lengths[i]
    layout = Packing(width=width, rows=max(1, len(fill)), places=tuple(places), lengths=lengths)
    if layout.packed:
        return layout
    return Packing(width=width, rows=max(1, len(lengths)),
                   places=tuple((i, 0) for i in range(len(lengths))), lengths=lengths)


def packed_rows(seqs: Sequence[Sequence[int]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor | None, Packing]:
    """(tokens (R, W), positions or None where nothing shares a row, the layout) of `seqs`."""
    layout = pack([len(s) for s in seqs])
    positions = layout.positions(device) if layout.packed else None
    return layout.tokens(seqs, device), positions, layout


def accepts_positions(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward takes `positions` [Note: packed rows]."""
    return "positions" in inspect.signature(module.forward).parameters


# [Note: varlen attention] On CUDA in half precision, packed rows run torch's variable-length
# flash kernel (`torch.nn.attention.varlen.varlen_attn`) on the segments laid end to end: no
# (T, T) mask, no work across segments. The layout it needs (cumulative segment starts, the
# longest segment) comes from `positions` alone; `varlen` takes the kernel as an argument so
# that the CPU tests run the same plumbing with a reference kernel (tests/torch/test_packing.py),
# and the GPU check runs the real one. Elsewhere SDPA takes the block-diagonal causal mask.
Kernel = Callable[..., torch.Tensor]


def varlen_kernel(q: torch.Tensor) -> Kernel | None:
    """torch's varlen flash kernel where it runs `q` [Note: varlen attention], else None."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=8)
def _arguments(kernel: Kernel) -> frozenset[str]:
    """The keyword arguments a varlen kernel takes: torch's has changed between versions."""
    return frozenset(inspect.signature(kernel).parameters)


class BlockCausal:
    """Causal attention within the segments that `positions` (B, T) mark [Note: packed rows];
    made once a forward, used by every layer."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.segments = torch.cumsum(positions == 0, dim=-1)  # (B, T)
        self._mask: torch.Tensor | None = None
        self._segments_end_to_end: tuple[torch.Tensor, int] | None = None

    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: a query sees the keys of its segment at or before it."""
        if self._mask is None:
            s, T = self.segments, self.segments.size(-1)
            causal = torch.ones(T, T, dtype=torch.bool, device=s.device).tril()
            self._mask = ((s[:, :, None] == s[:, None, :]) & causal)[:, None]
        return self._mask

    def additive(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """The mask as HF layers take it, 0 or the dtype's lowest; a sliding layer sees the
        last `window` positions of its segment."""
        seen = self.mask()
        if window is not None:
            p = self.positions
            seen = seen & (p[:, None, :] > p[:, :, None] - window)[:, None]
        out = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
        return out.masked_fill_(~seen, torch.finfo(dtype).min)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               dropout_p: float = 0.0) -> torch.Tensor:
        """SDPA of (B, nh, T, hs) within segments: the varlen kernel where it runs."""
        kernel = varlen_kernel(q) if dropout_p == 0.0 else None
        if kernel is not None:
            return self.varlen(q, k, v, kernel)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(), dropout_p=dropout_p)

    def end_to_end(self) -> tuple[torch.Tensor, int]:
        """(cumulative starts (N+1,) int32, the longest segment) of the segments laid end to
        end, made once a forward: the longest is read on the host, one sync, not one a layer."""
        if self._segments_end_to_end is None:
            flat = self.positions.reshape(-1)
            starts = torch.nonzero(flat == 0).reshape(-1)
            cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
            self._segments_end_to_end = (cu, int(flat.max()) + 1)
        return self._segments_end_to_end

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kernel: Kernel) -> torch.Tensor:
        """`kernel` (varlen_attn's signature) over the segments end to end [Note: varlen
        attention]; back to (B, nh, T, hs)."""
        B, nh, T, hs = q.shape
        cu, longest = self.end_to_end()

        def tokens(t: torch.Tensor) -> torch.Tensor:  # (B, h, T, hs) -> (B*T, h, hs)
            return t.transpose(1, 2).reshape(B * T, t.size(1), hs)

        k, v = tokens(k), tokens(v)
        takes = _arguments(kernel)
        causal = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
        if nh % k.size(1):
            raise ValueError(f"{nh} query heads cannot share {k.size(1)} key/value heads evenly")
        if k.size(1) != nh and "enable_gqa" not in takes:
            # torch 2.11's kernel takes no `enable_gqa`: each key/value head serves its group
            k, v = (t.repeat_interleave(nh // t.size(1), dim=1) for t in (k, v))
        elif k.size(1) != nh:
            causal["enable_gqa"] = True
        y = kernel(tokens(q), k, v, cu, cu, longest, longest, **causal)
        return y.reshape(B, T, nh, hs).transpose(1, 2)
