"""RL losses of the last pipeline stage on a microbatch of `Experience` records: the clipped
policy loss of PPO and GRPO (GRPO with a KL term to a reference; with `decoupled`, AReaL's
decoupled PPO objective for stale samples, Fu et al. 2025) and the critic's clipped value loss. The
math is `executors.torch.algos` (verl's); this module lays the records out as the
(batch, response) tensors it takes and reads the stage's output where each response token was
predicted [Note: response positions in executors/torch/infer.py].

[Note: RL losses in sum form] verl's token-mean divides the batch's summed per-token loss by
the batch's response tokens. A microbatch must not divide by its own token count (its tokens
would then weigh more or less depending on how the batch was cut) and cannot know the batch's
(streamed microbatches form before the batch is complete). So the last stage backpropagates
the SUM of the per-token loss over its microbatch's response tokens, its stats carry that
token count as `normalizer`, and the optimizer step divides every gradient by the step's
summed normalizer: the whole batch's token-mean gradient, however it was cut and padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from executors.torch.algos import (
    decoupled_ppo_policy_loss,
    decoupled_weight_stats,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)
from flowkit.ops import LOSS_KNOBS, SUM_FORM_LOSSES

__all__ = ["RL_LOSSES", "RLLoss", "RLSettings", "records", "sequence_ids"]

RL_LOSSES = SUM_FORM_LOSSES  # every RL loss here is in sum form [Note: RL losses in sum form]
_PER_TOKEN_FIELDS = {"policy": ("logprobs", "advantages"), "value": ("values", "returns")}


@attrs.frozen(kw_only=True)
class RLSettings:
    """A loss and its knobs, as the Backprop node's config names them (flowkit.ops.LOSS_KNOBS,
    with their defaults)."""

    loss: str
    clip_ratio: float = attrs.field(default=LOSS_KNOBS["clip_ratio"], converter=float)
    clip_ratio_c: float = attrs.field(default=LOSS_KNOBS["clip_ratio_c"], converter=float)
    kl_coef: float = attrs.field(default=LOSS_KNOBS["kl_coef"],
                                 converter=lambda v: float(v or 0.0))
    kl_kind: str = attrs.field(default=LOSS_KNOBS["kl_kind"], converter=str)
    temperature: float = attrs.field(default=LOSS_KNOBS["temperature"], converter=float)
    cliprange_value: float = attrs.field(default=LOSS_KNOBS["cliprange_value"], converter=float)
    # AReaL's decoupled PPO objective for stale samples (Fu et al. 2025); see LOSS_KNOBS
    decoupled: bool = attrs.field(default=LOSS_KNOBS["decoupled"],
                                  validator=attrs.validators.instance_of(bool))
    behav_cap: float = attrs.field(default=LOSS_KNOBS["behav_cap"], converter=float)

    @behav_cap.validator
    def _positive_cap(self, _attribute: Any, value: float) -> None:
        # at settings time, not at the first decoupled loss deep inside a pipeline stage
        if not value > 0:
            raise ValueError(f"behav_cap is {value}, expected > 0: it caps the importance "
                             f"weight of the decoupled PPO objective")

    @classmethod
    def from_config(cls, loss: str, config: dict) -> RLSettings:
        names = {f.name for f in attrs.fields(cls)} - {"loss"}
        return cls(loss=loss, **{k: v for k, v in config.items() if k in names})

    @property
    def uses_reference(self) -> bool:
        return self.loss == "grpo" and self.kl_coef != 0.0


def records(value: Any) -> list:
    """A microbatch input as a list of records (a Gather arrives as a list; one record alone)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def sequence_ids(experiences: Sequence[Any], device: torch.device) -> torch.Tensor:
    """(B, T) what stage 0 runs: each prompt + response without its last token, right-padded
    with 0 (the model is causal, so pads after a sequence change nothing before them)."""
    seqs = [list(e.prompt_tokens) + list(e.response_tokens) for e in experiences]
    width = max([len(s) - 1 for s in seqs] + [1])  # an empty microbatch still has a shape
    rows = [s[:-1] + [0] * (width - len(s) + 1) for s in seqs]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(seqs), width)


class RLLoss:
    """The last stage's loss on one microbatch, called on the stage's output (logits (B, T, V)
    or values (B, T)) inside its forward so that the runner's graph reaches it. Returns the sum
    form [Note: RL losses in sum form]; `tokens` is what the sum is over."""

    def __init__(self, experiences: Sequence[Any], refs: Sequence[Any], settings: RLSettings,
                 device: torch.device) -> None:
        self.settings = settings
        self.values: dict[str, float] = {}  # what the loss reports besides itself
        self.kind = "value" if settings.loss == "value" else "policy"
        exps = list(experiences)
        width = max([len(e.response_tokens) for e in exps] + [0])
        _need_prompts(exps)

        def padded(rows: list, dtype: torch.dtype) -> torch.Tensor:
            rows = [list(r) + [0] * (width - len(r)) for r in rows]
            return torch.tensor(rows, dtype=dtype, device=device).reshape(len(exps), width)

        # response token k of a sample with P prompt tokens is predicted at position P + k - 1
        self.positions = padded([[len(e.prompt_tokens) - 1 + k
                                  for k in range(len(e.response_tokens))] for e in exps],
                                torch.long)
        self.tokens_at = padded([e.response_tokens for e in exps], torch.long)
        self.mask = padded([[1.0] * len(e.response_tokens) for e in exps], torch.float64)
        self.tokens = int(self.mask.sum())
        self.columns = {name: padded(_per_token(exps, name), torch.float64)
                        for name in _PER_TOKEN_FIELDS[self.kind]}
        if settings.uses_reference:
            self.columns["ref_logprobs"] = padded(_reference_logprobs(exps, refs, settings),
                                                  torch.float64)

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        self._check_output(output)
        if self.tokens == 0:  # nothing to learn from, but B still needs a graph to run
            return output.sum() * 0.0
        if self.kind == "value":
            return self._value_sum(output)
        return self._policy_sum(output)

    def _policy_sum(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.settings
        # float32 at least: a bf16 log-softmax is too coarse for a ratio that starts at 1
        dtype = torch.promote_types(logits.dtype, torch.float32)
        col = {k: v.to(dtype) for k, v in self.columns.items()}
        mask = self.mask.to(dtype)
        picked = logits.gather(1, self.positions[..., None].expand(-1, -1, logits.size(-1)))
        temperature = s.temperature if s.temperature > 0 else 1.0  # greedy records 1
        logp = F.log_softmax(picked.to(dtype) / temperature, dim=-1)
        logp = logp.gather(-1, self.tokens_at[..., None]).squeeze(-1)  # (B, R)
        # token-mean times the token count: the masked sum, through verl's own loss
        if s.decoupled:
            total = self._decoupled_sum(logp, col, mask)
        else:
            total = ppo_policy_loss(col["logprobs"], logp, col["advantages"], mask,
                                    clip_ratio=s.clip_ratio, clip_ratio_c=s.clip_ratio_c,
                                    agg="token-mean") * self.tokens
        if s.uses_reference:
            kl = kl_penalty(logp, col["ref_logprobs"], s.kl_kind)
            total = total + s.kl_coef * torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum()
        return total

    def _decoupled_sum(self, logp: torch.Tensor, col: dict, mask: torch.Tensor) -> torch.Tensor:
        """AReaL's decoupled PPO objective (Fu et al. 2025) in sum form. Each sample gets one
        optimizer update per step, so the proximal policy (the weights before this update) is
        this forward pass's, detached: no extra pass; the records' logprobs are the behaviour
        policy's, whatever weights version sampled them."""
        s = self.settings
        stats = decoupled_weight_stats(col["logprobs"], logp.detach(), mask, s.behav_cap)
        self.values = {key: float(value) for key, value in stats.items()}
        return decoupled_ppo_policy_loss(col["logprobs"], logp.detach(), logp,
                                         col["advantages"], mask, clip_ratio=s.clip_ratio,
                                         clip_ratio_c=s.clip_ratio_c, behav_cap=s.behav_cap,
                                         agg="token-mean") * self.tokens

    def _value_sum(self, values: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(values.dtype, torch.float32)
        predicted = values.gather(1, self.positions).to(dtype)  # (B, R)
        col = {k: v.to(dtype) for k, v in self.columns.items()}
        loss = value_loss(predicted, col["returns"], col["values"], self.mask.to(dtype),
                          clip_range=self.settings.cliprange_value, agg="token-mean")
        return loss * self.tokens

    def _check_output(self, output: torch.Tensor) -> None:
        if self.kind == "value" and output.dim() != 2:
            raise ValueError(f"loss 'value' reads one value per position from a critic (a GPT "
                             f"with value_head=True; set model_config value_head: true), but "
                             f"this model's last stage returned shape {tuple(output.shape)}")
        if self.kind == "policy" and output.dim() != 3:
            raise ValueError(f"loss {self.settings.loss!r} reads next-token logits (B, T, vocab), "
                             f"but this model's last stage returned shape "
                             f"{tuple(output.shape)}: a value head? train it with loss 'value'")


def _name(e: Any) -> str:
    return f"prompt_id={e.prompt_id} sample={e.sample}"


def _need_prompts(exps: list) -> None:
    for e in exps:
        if e.response_tokens and not e.prompt_tokens:
            raise ValueError(f"sample {_name(e)} has no prompt tokens: its first response token "
                             "has no position to be predicted from")


def _per_token(exps: list, field: str) -> list[list[float]]:
    """`field` of each experience, one float per response token."""
    rows = [list(getattr(e, field)) for e in exps]
    for e, row in zip(exps, rows):
        if len(row) != len(e.response_tokens):
            raise ValueError(f"sample {_name(e)} has {len(row)} {field} for "
                             f"{len(e.response_tokens)} response tokens; they must match")
    return rows


def _reference_logprobs(exps: list, refs: Sequence[Any], settings: RLSettings) -> list:
    """Each sample's reference log-probs: from the ref_logprobs input (TokenScores) when it is
    wired, else the ones the experience carries."""
    if not refs:
        lacking = [e for e in exps if e.response_tokens and not e.ref_logprobs]
        if lacking:
            raise ValueError(
                f"loss {settings.loss!r} with kl_coef={settings.kl_coef} needs reference "
                f"log-probs, and sample {_name(lacking[0])} has none: wire LogProbs(reference) "
                "to Backprop's ref_logprobs input, or fill Experience.ref_logprobs")
        return _per_token(exps, "ref_logprobs")
    rows = [list(_matching_ref(e, i, refs).values) for i, e in enumerate(exps)]
    for e, row in zip(exps, rows):
        if len(row) != len(e.response_tokens):
            raise ValueError(f"sample {_name(e)} has {len(row)} ref_logprobs (from the "
                             f"ref_logprobs input) for {len(e.response_tokens)} response tokens")
    return rows


def _matching_ref(e: Any, i: int, refs: Sequence[Any]) -> Any:
    """The reference scores of sample `e`: the runtime gathers both inputs in the same order,
    so refs[i] normally is; otherwise the one with its (prompt_id, sample)."""
    key = (e.prompt_id, e.sample)
    if i < len(refs) and (refs[i].prompt_id, refs[i].sample) == key:
        return refs[i]
    for ref in refs:
        if (ref.prompt_id, ref.sample) == key:
            return ref
    raise ValueError(f"no reference log-probs for sample {_name(e)} among the "
                     f"{len(refs)} of the ref_logprobs input")
