"""The torch executor's inference ops on rollouts: `logprobs` (a policy or frozen reference),
`values` (a critic: a model whose forward gives values, such as the GPT with a value head) and
`reward_model` (such a model read at the sequence's last position). Any model that follows
[Note: generation and scoring interface] (executors/torch/lm.py) runs them.

Each takes one Rollout or a list of them and answers in kind (one result, or a list in the same
order), so each is its own batched form: a batched task of ready rollouts [Note: batched forms
in executors/optable.py] runs them in forwards of up to `max_batch` sequences and `max_tokens`
padded tokens, right-padded: the model is causal, so pads after a sequence change nothing
before them, and each rollout's scores are those it gets alone (to float rounding).

[Note: response positions] Response token k of a rollout with P prompt tokens sits at position
P + k of prompt + response, and is predicted by the model's output at position P + k - 1. Its
log-probability and its value both come from that earlier position (the state the sampler was
in when it chose the token), as in verl's ``values[:, -response_length - 1:-1]``; the sequence
run is prompt + response without its last token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from executors.optable import OpContext, OpTable
from executors.torch import lm
from executors.torch.held import evaluating, right_padded, whole_model
from flowkit.ops.records import TokenScores

__all__ = ["register"]

_MAX_TOKENS = 16384  # padded tokens in one forward: bounds the activations of a batch


def _logprobs(ctx: OpContext, rollouts: Any, *_: Any, temperature: float = 1.0,
              max_batch: int = 32, max_tokens: int = _MAX_TOKENS, **config: Any) -> Any:
    """Per-token ``log_softmax(logits / temperature)`` of each response token: the convention
    of the sampler's logprobs [Note: sampler log-probabilities in executors/torch/generate.py]."""
    t = float(temperature) if float(temperature) > 0 else 1.0  # greedy records temperature 1

    def score(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = lm.logits_of(out, "logprobs")
        logp = F.log_softmax(logits.to(torch.float64) / t, dim=-1)  # (B, T, V)
        return logp.gather(-1, targets[..., None]).squeeze(-1)  # (B, T)

    return _per_token(ctx, rollouts, score, (int(max_batch), int(max_tokens)), config)


def _values(ctx: OpContext, rollouts: Any, *_: Any, max_batch: int = 32,
            max_tokens: int = _MAX_TOKENS, **config: Any) -> Any:
    """Per-token values of each response from a critic [Note: response positions]."""
    return _per_token(ctx, rollouts, lambda out, _: lm.values_of(out, "values"),
                      (int(max_batch), int(max_tokens)), config)


def _reward_model(ctx: OpContext, rollouts: Any, *_: Any, max_batch: int = 32,
                  max_tokens: int = _MAX_TOKENS, **config: Any) -> Any:
    """A score per rollout: a critic's value at the last token of prompt + response (the whole
    sequence is run here, unlike `values`)."""
    items, one = _as_list(rollouts)
    model = whole_model(ctx, config)
    scores = []
    for chunk in _chunks(items, (int(max_batch), int(max_tokens)), whole=True):
        seqs = [list(r.prompt_tokens) + list(r.response_tokens) for r in chunk]
        out = lm.values_of(_run(model, seqs, chunk), "reward_model")  # (B, T)
        scores += [float(out[b, len(s) - 1]) for b, s in enumerate(seqs)]
    return scores[0] if one else scores


# -- shared -----------------------------------------------------------------------------------
def _per_token(ctx: OpContext, rollouts: Any, score, limits: tuple[int, int],
               config: dict) -> Any:
    """TokenScores of each rollout: `score(model output, next tokens)` (B, T) read at the
    positions that predict the response [Note: response positions]."""
    items, one = _as_list(rollouts)
    model = whole_model(ctx, config)
    results = []
    for chunk in _chunks(items, limits):
        full = [list(r.prompt_tokens) + list(r.response_tokens) for r in chunk]
        out = _run(model, [s[:-1] for s in full], chunk)
        targets = right_padded([s[1:] for s in full], out.device)
        scores = score(out, targets)
        for b, r in enumerate(chunk):
            start, stop = len(r.prompt_tokens) - 1, len(full[b]) - 1
            results.append(TokenScores(prompt_id=r.prompt_id, sample=r.sample,
                                       values=scores[b, start:stop].tolist()))
    return results[0] if one else results


def _run(model: torch.nn.Module, seqs: list[list[int]], rollouts: list) -> torch.Tensor:
    """The model's output on right-padded sequences (those of `rollouts`): logits (B, T, V) or
    values (B, T)."""
    context = lm.context_length(model)
    long = [(r, len(s)) for r, s in zip(rollouts, seqs) if context and len(s) > context]
    if long:
        (r, n), more = long[0], f" (and {len(long) - 1} more)" if len(long) > 1 else ""
        raise ValueError(f"rollout (prompt {r.prompt_id}, sample {r.sample}) runs {n} tokens, "
                         f"past the model's context_length {context}{more}: score with a model "
                         "whose context holds prompt + response")
    device = next(model.parameters()).device
    with evaluating(model):
        return model(right_padded(seqs, device))


def _as_list(rollouts: Any) -> tuple[list, bool]:
    one = not isinstance(rollouts, (list, tuple))
    return ([rollouts] if one else list(rollouts)), one


def _chunks(items: list, limits: tuple[int, int], *, whole: bool = False):
    """Consecutive runs of `items` for one forward each: at most `limits` = (sequences, padded
    tokens), one rollout at least. A sequence is prompt + response, less its last token unless
    `whole`."""
    most, budget = max(1, limits[0]), max(1, limits[1])
    chunk: list = []
    longest = 0
    for r in items:
        length = len(r.prompt_tokens) + len(r.response_tokens) - (0 if whole else 1)
        widest = max(longest, length)
        if chunk and (len(chunk) == most or widest * (len(chunk) + 1) > budget):
            yield chunk
            chunk, widest = [], length
        chunk.append(r)
        longest = widest
    if chunk:
        yield chunk


def register(table: OpTable) -> None:
    # each takes a list of rollouts as well: that is its batched form
    table.register("logprobs", _logprobs, batched=_logprobs)
    table.register("values", _values, batched=_values)
    table.register("reward_model", _reward_model, batched=_reward_model)
