"""Token sources for language-model pretraining and SFT: byte-tokenized text, no downloads.

`synthetic_corpus` writes English-like text from a small grammar, so the examples have data on
a machine without internet: `python -m dataflows.text OUT.txt` regenerates the shipped file.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from flowkit.dsl import Stream, op
from flowkit.ops.records import TokenIds

__all__ = ["synthetic_corpus", "token_sequences"]


@op
def token_sequences(*, path: str, sequences: int = 32, seq_len: int = 128, seed: int = 0,
                    step: int = 0) -> Stream[TokenIds]:
    """`sequences` random windows of seq_len+1 bytes from a text file (token id = byte), one
    item each, different every step: inputs are window[:-1], targets window[1:]. The pipeline
    cuts a step's items into microbatches, so their count is the global batch size."""
    data = _bytes(path, seq_len)
    rng = random.Random(f"{seed}/{step}")
    for _ in range(sequences):
        start = rng.randrange(len(data) - seq_len - 1)
        yield data[start:start + seq_len + 1].clone()


def _bytes(path: str, seq_len: int):
    import torch  # only executors run these ops; declaring a flow must not need torch

    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
    if len(data) <= seq_len + 1:
        raise ValueError(f"{path} has {len(data)} bytes; need more than seq_len+1={seq_len + 1}")
    return data


# -- a corpus to train on ---------------------------------------------------------------------
_WORDS = {
    "det": "the a this that every one some no".split(),
    "adj": ("quick small old young bright quiet heavy gentle clever tired busy patient "
            "little large green red").split(),
    "noun": ("fox dog river engine farmer teacher bird city garden model student market "
             "mountain window letter storm").split(),
    "verb": ("sees finds follows builds carries watches helps paints visits trains "
             "answers opens").split(),
    "prep": "near under over beside behind across into through".split(),
    "adv": "slowly quickly often never always carefully quietly".split(),
}


def synthetic_corpus(n_bytes: int = 120_000, seed: int = 0) -> str:
    """Sentences from a small grammar: structure a byte-level model learns within minutes."""
    rng = random.Random(seed)
    pick = lambda kind: rng.choice(_WORDS[kind])  # noqa: E731 - a local shorthand
    out: list[str] = []
    size = 0
    while size < n_bytes:
        subject = f"{pick('det')} {pick('adj')} {pick('noun')}"
        sentence = f"{subject} {pick('verb')} {pick('det')} {pick('noun')}"
        if rng.random() < 0.5:
            sentence += f" {pick('prep')} {pick('det')} {pick('adj')} {pick('noun')}"
        if rng.random() < 0.3:
            sentence += f" {pick('adv')}"
        sentence = sentence[0].upper() + sentence[1:] + "."
        out.append(sentence)
        size += len(sentence) + 1
    return "\n".join(" ".join(out[i:i + 4]) for i in range(0, len(out), 4)) + "\n"


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(synthetic_corpus())
