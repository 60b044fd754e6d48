"""The torch executor's inference ops on rollouts: `logprobs` (a policy or frozen reference),
`values` (a critic: a model whose forward gives values, such as the GPT with a value head) and
`reward_model` (such a model read at the sequence's last position). Any model that follows
[Note: generation and scoring interface] (executors/torch/rollout/lm.py) runs them.

Each takes one Rollout or a list of them and answers in kind (one result, or a list in the same
order), so each is its own batched form: a batched task of ready rollouts [Note: batched forms
in executors/optable.py] runs them in few forwards, right-padded (the model is causal, so pads
after a sequence change nothing before them).

[Note: batch-invariant forwards] Which rollouts share a forward depends on when they finished,
so a forward's shape must not change a rollout's scores: a matmul's rounding depends on its
shape. Every forward therefore has a shape fixed by its rows' own lengths: a rollout's width is
its length rounded up to a power of two or one and a half times one (16 at least: 16, 24, 32,
48, ...: at most a third of a forward's tokens are padding, and the shapes stay few); rollouts
of one width share forwards of exactly `rows` = min(max_batch, max_tokens // width) rows,
padded with empty rows. A rollout's scores are then the same bits alone or in any batch (the
approach of batch-invariant inference kernels), and a run's results do not depend on its timing.
The price: a rollout that comes alone still runs a forward of `rows` rows. The token budget is
the device's: 4096 on a GPU, whose forward costs about as much for one row as for 32, and 256 on
a CPU, whose forward costs in proportion to its rows; `flowkit bench infer` measures both
budgets on a step's 128 rollouts (docs/performance.md).

[Note: response positions] Response token k of a rollout with P prompt tokens sits at position
P + k of prompt + response, and is predicted by the model's output at position P + k - 1. Its
log-probability and its value both come from that earlier position (the state the sampler was
in when it chose the token), as in verl's ``values[:, -response_length - 1:-1]``; the sequence
run is prompt + response without its last token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from executors.optable import OpContext, OpTable
from executors.torch.models.built import evaluating, right_padded, whole_model
from executors.torch.models.packing import Packing, pack
from executors.torch.rollout import lm
from executors.torch.rollout.sampling import token_logprobs
from flowkit.ops.records import TokenScores

__all__ = ["register"]

# padded tokens in one forward, by device [Note: batch-invariant forwards]: bounds its
# activations (its logits are tokens x vocabulary; their log-softmax is taken in chunks: [Note:
# chunked log-probabilities] in sampling.py) and what a lone rollout's fixed-shape forward costs
_MAX_TOKENS = {"cuda": 4096, "cpu": 256}
_MIN_WIDTH = 16  # [Note: batch-invariant forwards]: the narrowest forward


def _logprobs(ctx: OpContext, rollouts: Any, *_: Any, temperature: float = 1.0,
              max_batch: int = 32, max_tokens: int | None = None, **config: Any) -> Any:
    """Per-token ``log_softmax(logits / temperature)`` of each response token: the convention
    of the sampler's logprobs [Note: sampler log-probabilities in
    executors/torch/rollout/generate.py], in chunks of positions, in the model's precision (at
    least float32) [Note: chunked log-probabilities in executors/torch/rollout/sampling.py]."""
    t = float(temperature) if float(temperature) > 0 else 1.0  # greedy records temperature 1

    def score(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # the vocabulary-wide log-softmax only where it is read (`targets` covers the real rows
        # up to their last response token): each position normalises alone, so a row's values
        # are the same whatever is computed beside them
        logits = lm.logits_of(out, "logprobs")[:targets.size(0), :targets.size(1)]
        return token_logprobs(logits, targets, temperature=t)  # (B, T)

    return _per_token(ctx, rollouts, score, (max_batch, max_tokens), config)


def _values(ctx: OpContext, rollouts: Any, *_: Any, max_batch: int = 32,
            max_tokens: int | None = None, **config: Any) -> Any:
    """Per-token values of each response from a critic [Note: response positions]."""
    return _per_token(ctx, rollouts, lambda out, _: lm.values_of(out, "values"),
                      (max_batch, max_tokens), config)


def _reward_model(ctx: OpContext, rollouts: Any, *_: Any, max_batch: int = 32,
                  max_tokens: int | None = None, **config: Any) -> Any:
    """A score per rollout: a critic's value at the last token of prompt + response (the whole
    sequence is run here, unlike `values`)."""
    items, one = _as_list(rollouts)
    model = whole_model(ctx, config)
    scores: list = [None] * len(items)
    if config.get("packing"):
        for i, seq, out in _packed(model, items, _limits(model, (max_batch, max_tokens)),
                                   whole=True):
            scores[i] = float(lm.values_of(out[None], "reward_model")[0, len(seq) - 1])
        return scores[0] if one else scores
    context = lm.context_length(model)
    for indices, shape in _forwards(items, _limits(model, (max_batch, max_tokens)), context,
                                    whole=True):
        seqs = [list(items[i].prompt_tokens) + list(items[i].response_tokens) for i in indices]
        out = lm.values_of(_run(model, seqs, [items[i] for i in indices], shape),
                           "reward_model")  # (rows, width)
        for b, (i, seq) in enumerate(zip(indices, seqs)):
            scores[i] = float(out[b, len(seq) - 1])
    return scores[0] if one else scores


# -- shared -----------------------------------------------------------------------------------
def _per_token(ctx: OpContext, rollouts: Any, score, limits: tuple[int, int],
               config: dict) -> Any:
    """TokenScores of each rollout: `score(model output, next tokens)` (B, T) read at the
    positions that predict the response [Note: response positions]."""
    items, one = _as_list(rollouts)
    model = whole_model(ctx, config)
    results: list = [None] * len(items)
    if config.get("packing"):
        for i, seq, out in _packed(model, items, _limits(model, limits)):
            r = items[i]
            targets = torch.tensor([list(r.prompt_tokens)[1:] + list(r.response_tokens)],
                                   dtype=torch.long, device=out.device)
            row = score(out[None], targets)[0]
            results[i] = TokenScores(prompt_id=r.prompt_id, sample=r.sample,
                                     values=row[len(r.prompt_tokens) - 1:len(seq)].tolist())
        return results[0] if one else results
    for indices, shape in _forwards(items, _limits(model, limits), lm.context_length(model)):
        chunk = [items[i] for i in indices]
        full = [list(r.prompt_tokens) + list(r.response_tokens) for r in chunk]
        out = _run(model, [s[:-1] for s in full], chunk, shape)
        targets = right_padded([s[1:] for s in full], out.device)  # the real rows' widths
        scores = score(out, targets)
        for b, (i, r) in enumerate(zip(indices, chunk)):
            start, stop = len(r.prompt_tokens) - 1, len(full[b]) - 1
            results[i] = TokenScores(prompt_id=r.prompt_id, sample=r.sample,
                                     values=scores[b, start:stop].tolist())
    return results[0] if one else results


def _run(model: torch.nn.Module, seqs: list[list[int]], rollouts: list,
         shape: tuple[int, int]) -> torch.Tensor:
    """The model's output on the sequences (those of `rollouts`) padded to `shape` (rows,
    width) [Note: batch-invariant forwards]: logits (rows, width, V) or values (rows, width)."""
    _check_context(model, seqs, rollouts)
    device = next(model.parameters()).device
    with evaluating(model):
        return model(right_padded(seqs, device, shape))


# [Note: packed scoring] A model with packing scores a call's rollouts in packed rows (rows of
# its longest sequence's width, at most max_tokens of them a forward; [Note: packed rows in
# executors/torch/models/packing.py]): fewer padded tokens, but a forward's shape then depends
# on which rollouts share it, so its scores equal the padded path's to rounding, not bit for
# bit alone and in any batch [Note: batch-invariant forwards].
def _packed(model: torch.nn.Module, items: list, limits: tuple[int, int], *,
            whole: bool = False) -> Iterator[tuple[int, list[int], torch.Tensor]]:
    """(index, sequence, the model's output over its positions) of each rollout, in packed
    rows [Note: packed scoring]; a sequence is prompt + response, less its last token unless
    `whole`."""
    seqs = [(list(r.prompt_tokens) + list(r.response_tokens))[:None if whole else -1]
            for r in items]
    _check_context(model, seqs, items)
    layout = pack([len(s) for s in seqs])
    per = max(1, min(limits[0], limits[1] // layout.width))
    device = next(model.parameters()).device
    for first in range(0, layout.rows, per):
        indices = [i for i, (row, _) in enumerate(layout.places) if first <= row < first + per]
        part = Packing(width=layout.width, rows=min(per, layout.rows - first),
                       places=tuple((layout.places[i][0] - first, layout.places[i][1])
                                    for i in indices),
                       lengths=tuple(layout.lengths[i] for i in indices))
        positions = part.positions(device) if part.packed else None
        with evaluating(model):
            out = model(part.tokens([seqs[i] for i in indices], device), None, positions)
        for i, (row, offset) in zip(indices, part.places):
            yield i, seqs[i], out[row, offset:offset + len(seqs[i])]


def _check_context(model: torch.nn.Module, seqs: list[list[int]], rollouts: list) -> None:
    context = lm.context_length(model)
    long = [(r, len(s)) for r, s in zip(rollouts, seqs) if context and len(s) > context]
    if long:
        (r, n), more = long[0], f" (and {len(long) - 1} more)" if len(long) > 1 else ""
        raise ValueError(f"rollout (prompt {r.prompt_id}, sample {r.sample}) runs {n} tokens, "
                         f"past the model's context_length {context}{more}: score with a model "
                         "whose context holds prompt + response")


def _limits(model: torch.nn.Module, limits: tuple[int, int | None]) -> tuple[int, int]:
    """(rows, padded tokens) at most a forward: `max_tokens` by the model's device unless set
    [Note: batch-invariant forwards]."""
    max_batch, max_tokens = limits
    if max_tokens is None:
        device = next(model.parameters()).device.type
        max_tokens = _MAX_TOKENS.get(device, _MAX_TOKENS["cuda"])
    return int(max_batch), int(max_tokens)


def _as_list(rollouts: Any) -> tuple[list, bool]:
    one = not isinstance(rollouts, (list, tuple))
    return ([rollouts] if one else list(rollouts)), one


def _forwards(items: list, limits: tuple[int, int], context: int | None, *,
              whole: bool = False) -> Iterator[tuple[list[int], tuple[int, int]]]:
    """(indices into `items`, (rows, width)) of each forward [Note: batch-invariant forwards]:
    rollouts of one width together, `rows` = min(sequences, padded tokens // width) of them a
    forward; no wider than the model's `context`. A sequence is prompt + response, less its last
    token unless `whole`."""
    most, budget = max(1, limits[0]), max(1, limits[1])
    by_width: dict[int, list[int]] = {}
    for i, r in enumerate(items):
        length = len(r.prompt_tokens) + len(r.response_tokens) - (0 if whole else 1)
        width = _width(length)
        by_width.setdefault(min(width, context) if context else width, []).append(i)
    for width, indices in by_width.items():
        rows = max(1, min(most, budget // width))
        for begin in range(0, len(indices), rows):
            yield indices[begin:begin + rows], (rows, width)


def _width(length: int) -> int:
    """A forward's width for a sequence of `length` tokens: the least power of two, or one and
    a half times one, that holds it; 16 at least."""
    power = 1 << max(0, length - 1).bit_length()  # the least power of two >= length
    return max(_MIN_WIDTH, power * 3 // 4 if length <= power * 3 // 4 else power)


def register(table: OpTable) -> None:
    # each takes a list of rollouts as well: that is its batched form
    # batch-invariant forwards: their batched tasks merge [Note: merged tasks in tasks.py]
    table.register("logprobs", _logprobs, batched=_logprobs, merges=True)
    table.register("values", _values, batched=_values, merges=True)
    table.register("reward_model", _reward_model, batched=_reward_model, merges=True)
