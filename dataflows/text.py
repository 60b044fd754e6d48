"""A token-batch source for language-model pretraining and SFT: byte-tokenized text, no downloads."""

from __future__ import annotations

import random
from pathlib import Path

from dataflows.records import TokenIds
from flowkit.dsl import Stream, op

__all__ = ["token_batches"]


@op
def token_batches(*, path: str, batch_size: int = 8, seq_len: int = 128, batches: int = 8,
                  seed: int = 0) -> Stream[TokenIds]:
    """Random windows of seq_len+1 bytes from a text file (token id = byte), batch_size at a time:
    inputs are window[:-1] and targets window[1:], so each batch is (batch_size, seq_len + 1)."""
    import torch  # only executors run this op; declaring a flow must not need torch

    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
    if len(data) <= seq_len + 1:
        raise ValueError(f"{path} has {len(data)} bytes; need more than seq_len+1={seq_len + 1}")
    rng = random.Random(seed)
    for _ in range(batches):
        starts = [rng.randrange(len(data) - seq_len - 1) for _ in range(batch_size)]
        yield torch.stack([data[s:s + seq_len + 1] for s in starts])
