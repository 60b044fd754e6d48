"""A small byte-level LSTM language model: your own model, not the built-in GPT, trained and
sampled by the same flows (examples/lstm_sort_sft.py, examples/lstm_grpo_sort.py).

It follows the two contracts of the README's "Your own model": training (`forward(tokens,
targets)` returns the mean loss, `split(stages)` cuts it into pipeline stages) and generation
and scoring (`forward(tokens)` returns logits (B, T, V), or values (B, T) with `value_head`:
[Note: generation and scoring interface] in executors/torch/rollout/lm.py). It has no cache protocol
and no context length: an LSTM cannot resume a right-padded row, so generation recomputes each
prefix, which for sequences this short costs little. The flows name it
``build="tiny_lstm:TinyLSTM"``; executors import it from the flow file's folder.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyLSTM"]


class TinyLSTM(nn.Module):
    """Embedding -> LSTM -> linear head over bytes (or to one value per position)."""

    def __init__(self, *, vocab_size: int = 128, n_embd: int = 32, hidden: int = 128,
                 n_layer: int = 1, value_head: bool = False) -> None:
        super().__init__()
        self.value_head = value_head
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.lstm = nn.LSTM(n_embd, hidden, n_layer, batch_first=True)  # causal by nature
        self.head = nn.Linear(hidden, 1 if value_head else vocab_size)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        h, _ = self.lstm(self.wte(tokens))  # (B, T, hidden)
        return _head(self.head, h, targets, self.value_head)

    def split(self, stages: int, *, seq_len: int | None = None) -> list[nn.Module]:
        """One stage (the model itself), or two: embedding + LSTM, then the head and loss.
        The stages share this model's parameters."""
        if stages == 1:
            return [self]
        if stages == 2:
            return [_Body(self), _Head(self)]
        raise ValueError(f"TinyLSTM splits into 1 or 2 stages, not {stages}")


class _Body(nn.Module):
    def __init__(self, model: TinyLSTM) -> None:
        super().__init__()
        self.wte, self.lstm = model.wte, model.lstm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.wte(tokens))[0]  # (B, T, hidden)


class _Head(nn.Module):
    def __init__(self, model: TinyLSTM) -> None:
        super().__init__()
        self.head, self.value_head = model.head, model.value_head

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None):
        return _head(self.head, h, targets, self.value_head)


def _head(head: nn.Linear, h: torch.Tensor, targets: torch.Tensor | None, value_head: bool):
    """Logits (B, T, V) or values (B, T); with targets the mean loss: cross-entropy on next
    tokens (target -1 ignored), or for a value head the squared error against returns."""
    out = head(h)
    if value_head:
        values = out.squeeze(-1)
        return values if targets is None else F.mse_loss(values, targets.to(values.dtype))
    if targets is None:
        return out
    return F.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1), ignore_index=-1)
