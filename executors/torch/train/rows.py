"""The rows a training stage runs: a microbatch's token sequences as the model reads them, right-
padded or packed [Note: packed rows in executors/torch/models/packing.py], and the packed rows'
positions, which travel beside the activation from stage to stage.

[Note: packed activations] Only stage 0 and the last stage read a microbatch's data; a middle
stage knows its rows only through what the stage before it sends. So a stage that ran packed
rows sends (activation, positions) and the next one unpacks it (`activation`); B's gradient is
the activation's alone. The last stage lays its data out again (`pack` is a function of the
lengths alone), so its targets and loss positions fall where stage 0 put the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from executors.torch.models.built import evaluating
from executors.torch.models.packing import Packing, packed_rows
from executors.torch.rollout import lm
from executors.torch.train.rl_loss import records, sequence_ids

__all__ = ["activation", "experience_rows", "lm_rows", "reference_forward", "sent", "split_tokens",
           "tokens_of"]


def tokens_of(value: Any) -> torch.Tensor:
    """A microbatch of token sequences: a (B, T+1) tensor, or a list of them or of rows; or
    records with prompt and response tokens (experiences), right-padded with masked token 0
    (~0: read as 0, never a target) [TokenIds in flowkit/ops/records.py]."""
    if isinstance(value, torch.Tensor):
        return value if value.dim() == 2 else value.unsqueeze(0)
    items = records(value)
    if items and hasattr(items[0], "response_tokens"):
        seqs = [list(e.prompt_tokens) + list(e.response_tokens) for e in items]
        width = max(len(s) for s in seqs)
        return torch.tensor([s + [~0] * (width - len(s)) for s in seqs], dtype=torch.long)
    rows = [v if v.dim() == 2 else v.unsqueeze(0) for v in items]
    return torch.cat(rows)


def split_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, T+1) batch of TokenIds as the model reads it, (B, T) with each masked ~t read as t,
    and its (B, T) targets, -1 (what the losses ignore) where masked [TokenIds in
    flowkit/ops/records.py]."""
    return torch.where(tokens < 0, ~tokens, tokens)[:, :-1], tokens[:, 1:].clamp(min=-1)


def lm_rows(tokens: torch.Tensor, packing: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(read, targets, positions) of a (B, T+1) batch of TokenIds for the language-model loss:
    as `split_tokens` makes them, or with `packing`, each row cut after its last target (what
    follows is never read by a causal model's loss) and the rows packed, targets -1 between."""
    read, targets = split_tokens(tokens)
    if not packing:
        return read, targets, None
    trained = targets.ge(0)
    columns = torch.arange(targets.size(1), device=targets.device)
    last = torch.where(trained, columns, -1).max(dim=1).values
    lengths = [max(1, int(n) + 1) for n in last]
    seqs = [row[:n] for row, n in zip(read.tolist(), lengths)]
    ids, positions, layout = packed_rows(seqs, tokens.device)
    aims = layout.tokens([row[:n] for row, n in zip(targets.tolist(), lengths)], tokens.device,
                         fill=-1)
    return ids, aims, positions


def experience_rows(experiences: Sequence[Any], device: torch.device, packing: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None, Packing | None]:
    """(ids, positions, layout) stage 0 runs for experiences: each prompt + response without
    its last token, right-padded (`sequence_ids`) or with `packing` packed."""
    if not packing:
        return sequence_ids(experiences, device), None, None
    seqs = [(list(e.prompt_tokens) + list(e.response_tokens))[:-1] for e in experiences]
    ids, positions, layout = packed_rows(seqs, device)
    return ids, positions, layout


def activation(value: Any) -> tuple[Any, torch.Tensor | None]:
    """A stage's input from the stage before: (activation, its packed positions or None)
    [Note: packed activations]."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    return value, None


def sent(out: Any, positions: torch.Tensor | None) -> Any:
    """What a stage sends the next: its output, with the positions of packed rows."""
    return out if positions is None else (out, positions)


# [Note: reference in the F] With Backprop's `reference` (grpo_flow's reference_in_forward), the
# last stage's F takes the KL term's reference log-probs itself: the frozen reference, held
# whole on that executor, runs the microbatch's own rows (no autograd) just before the actor's
# forward, and the loss reads them where it reads the actor's. A LogProbs op instead scores
# rollouts as they finish, in forwards of a fixed shape per width (batch-invariant, [Note:
# batch-invariant forwards in executors/torch/rollout/infer.py]) that small batches pad: on
# the README's Qwen2 GRPO those calls took about 30 % of each executor (py-spy); in the forward
# the step is 0.81x theirs (0.201 s against 0.247 s, `flowkit bench trl --scored-reference`).
# The price: these scores depend on which rows share the microbatch to rounding, as the actor's
# own log-probs do.
def reference_forward(model: torch.nn.Module, ids: torch.Tensor,
                      positions: torch.Tensor | None) -> torch.Tensor:
    """The reference's logits (B, T, V) over the microbatch's rows [Note: reference in the F]."""
    with evaluating(model):
        out = model(ids) if positions is None else model(ids, None, positions)
    return lm.logits_of(out, "the reference in the forward")
