"""RL losses of the last pipeline stage on a microbatch of `Experience` records: the clipped
policy loss of PPO and GRPO (GRPO with a KL term to a reference; with `decoupled`, AReaL's
decoupled PPO objective for stale samples, Fu et al. 2025) and the critic's clipped value loss. The
math is `executors.torch.train.loss_terms` (verl's); this module lays the records out as the
(batch, response) tensors it takes and reads the stage's output where each response token was
predicted [Note: response positions in executors/torch/rollout/infer.py].

[Note: RL losses in sum form] verl's token-mean divides the batch's summed per-token loss by
the batch's response tokens. A microbatch must not divide by its own token count (its tokens
would then weigh more or less depending on how the batch was cut) and cannot know the batch's
(streamed microbatches form before the batch is complete). So the last stage backpropagates
the SUM of the per-token loss over its microbatch's response tokens, its stats carry that
token count as `normalizer`, and the optimizer step divides every gradient by the step's
summed normalizer: the whole batch's token-mean gradient, however it was cut and padded.
The other aggregation modes are alike (loss_terms.aggregate_sum): the seq-mean ones sum each
response's token mean, sum or sum over the constant, and count responses with tokens as the
normalizer. Every term of the loss (policy, KL, entropy) shares the mode, so one normalizer
serves them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from executors.torch.train.loss_terms import (
    aggregate_sum,
    behav_weights,
    decoupled_weight_stats,
    entropy_from_logprobs,
    gspo_token_losses,
    kl_penalty,
    ppo_token_losses_and_stats,
    rollout_is_weights,
    value_token_losses,
)
from flowkit.ops import LOSS_AGG_MODES, LOSS_KNOBS, POLICY_LOSSES, SUM_FORM_LOSSES

__all__ = ["RL_LOSSES", "RLLoss", "RLSettings", "records", "sequence_ids"]

RL_LOSSES = SUM_FORM_LOSSES  # every RL loss here is in sum form [Note: RL losses in sum form]
_PER_TOKEN_FIELDS = {"policy": ("logprobs", "advantages"), "value": ("values", "returns")}


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _knob(name: str, converter: Any = None, **kwargs: Any) -> Any:
    """An RLSettings field defaulting to LOSS_KNOBS[name]."""
    return attrs.field(default=LOSS_KNOBS[name], converter=converter, **kwargs)


@attrs.frozen(kw_only=True)
class RLSettings:
    """A loss and its knobs, as the Backprop node's config names them (flowkit.ops.LOSS_KNOBS,
    with their defaults and meanings)."""

    loss: str
    clip_ratio: float = _knob("clip_ratio", float)
    clip_ratio_c: float = _knob("clip_ratio_c", float)
    clip_ratio_low: float | None = _knob("clip_ratio_low", _optional_float)
    clip_ratio_high: float | None = _knob("clip_ratio_high", _optional_float)
    loss_agg_mode: str | None = _knob("loss_agg_mode")
    loss_scale_factor: float | None = _knob("loss_scale_factor", _optional_float)
    policy_loss: str = _knob("policy_loss", str)
    entropy_coeff: float = _knob("entropy_coeff", lambda v: float(v or 0.0))
    mask_truncated: bool = _knob("mask_truncated",
                                 validator=attrs.validators.instance_of(bool))
    kl_coef: float = _knob("kl_coef", lambda v: float(v or 0.0))
    kl_kind: str = _knob("kl_kind", str)
    temperature: float = _knob("temperature", float)
    cliprange_value: float = _knob("cliprange_value", float)
    # AReaL's decoupled PPO objective for stale samples (Fu et al. 2025); see LOSS_KNOBS
    decoupled: bool = _knob("decoupled", validator=attrs.validators.instance_of(bool))
    behav_cap: float = _knob("behav_cap", float)
    rollout_is: str | None = _knob("rollout_is")
    rollout_is_mode: str = _knob("rollout_is_mode", str)
    rollout_is_threshold: float = _knob("rollout_is_threshold", float)
    rollout_is_threshold_lower: float | None = _knob("rollout_is_threshold_lower",
                                                     _optional_float)
    rollout_is_veto_threshold: float | None = _knob("rollout_is_veto_threshold",
                                                    _optional_float)

    @behav_cap.validator
    def _positive_cap(self, _attribute: Any, value: float) -> None:
        # at settings time, not at the first decoupled loss deep inside a pipeline stage
        if not value > 0:
            raise ValueError(f"behav_cap is {value}, expected > 0: it caps the importance "
                             f"weight of the decoupled PPO objective")

    @policy_loss.validator
    def _known_policy_loss(self, _attribute: Any, value: str) -> None:
        if value not in POLICY_LOSSES:
            raise ValueError(f"policy_loss={value!r}; expected one of {', '.join(POLICY_LOSSES)}")

    @classmethod
    def from_config(cls, loss: str, config: dict) -> RLSettings:
        names = {f.name for f in attrs.fields(cls)} - {"loss"}
        return cls(loss=loss, **{k: v for k, v in config.items() if k in names})

    @property
    def uses_reference(self) -> bool:
        return self.loss == "grpo" and self.kl_coef != 0.0

    @property
    def agg(self) -> str:
        """The aggregation mode: the one given, else the policy loss's own (verl aggregates
        GSPO seq-mean-token-mean)."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"

    @property
    def proximal(self) -> bool:
        """Whether the ratio is taken against this forward's own log-probs (detached), with
        the records' log-probs weighing each token: the decoupled objective or a rollout
        correction."""
        return self.decoupled or self.rollout_is is not None


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
    form [Note: RL losses in sum form]: `normalizer` is what the sum is over (tokens, or
    responses with tokens), `tokens` the response tokens trained on. Its statistics stay on
    the device until `settle` fetches them with the loss, in one transfer: `normalizer` and
    `values` are known from then. With a `layout` (a Packing) the output's rows are packed
    rows and each experience is read where the layout put it [Note: packed rows in
    executors/torch/models/packing.py]; without one, experience i is row i."""

    def __init__(self, experiences: Sequence[Any], refs: Sequence[Any], settings: RLSettings,
                 device: torch.device, *, layout: Any = None,
                 reference: Callable[[], torch.Tensor] | None = None) -> None:
        _check_agg(settings)
        self.settings = settings
        self.values: dict[str, float] = {}  # token means the loss reports besides itself
        self.normalizer = 0.0
        # what `settle` fetches: the normalizer and the values, as tensors on the device
        self._pending: dict[str, torch.Tensor] = {}
        self.kind = "value" if settings.loss == "value" else "policy"
        exps = list(experiences)
        width = max([len(e.response_tokens) for e in exps] + [0])
        _need_prompts(exps)

        def padded(rows: list, dtype: torch.dtype) -> torch.Tensor:
            rows = [list(r) + [0] * (width - len(r)) for r in rows]
            return torch.tensor(rows, dtype=dtype, device=device).reshape(len(exps), width)

        # response token k of a sample with P prompt tokens is predicted at position P + k - 1
        # of its sequence, which starts at column `offset` of output row `row`
        places = layout.places if layout is not None else [(i, 0) for i in range(len(exps))]
        self.rows = torch.tensor([row for row, _ in places], dtype=torch.long,
                                 device=device).reshape(len(exps), 1)
        self.positions = padded([[offset + len(e.prompt_tokens) - 1 + k
                                  for k in range(len(e.response_tokens))]
                                 for e, (_, offset) in zip(exps, places)], torch.long)
        self.tokens_at = padded([e.response_tokens for e in exps], torch.long)
        # a cut response trains nothing with mask_truncated: its row is all padding; an
        # environment's tokens in a trajectory train nothing either [Note: multi-turn rollouts
        # in flowkit/ops/environments.py]
        trained = [not settings.mask_truncated or e.finished for e in exps]
        mask_rows = [[float(keep and bit) for bit in _trained_mask(e)]
                     for e, keep in zip(exps, trained)]
        self.mask = padded(mask_rows, torch.float64)
        self.tokens = int(sum(sum(row) for row in mask_rows))  # counted on the host
        # a tree rollout's leaf weighs the tokens it shares [Note: tree rollouts' shared prefix
        # in dataflows/rl/trees.py]; the aggregate weighs them so, its normalizer included
        self.weights = padded([_token_weights(e, settings) for e in exps], torch.float64) \
            if any(getattr(e, "token_weights", ()) for e in exps) else None
        self.columns = {name: padded(_per_token(exps, name), torch.float64)
                        for name in _PER_TOKEN_FIELDS[self.kind]}
        if settings.uses_reference and reference is not None:  # [Note: reference in the F]
            with torch.no_grad():
                self.columns["ref_logprobs"] = self._picked_logprobs(reference()).gather(
                    -1, self.tokens_at[..., None]).squeeze(-1).to(torch.float64)
        elif settings.uses_reference:
            self.columns["ref_logprobs"] = padded(_reference_logprobs(exps, refs, settings),
                                                  torch.float64)

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        self._check_output(output)
        if self.tokens == 0:  # nothing to learn from, but B still needs a graph to run
            return output.sum() * 0.0
        if self.kind == "value":
            losses, mask = self._value_losses(output)
        else:
            losses, mask = self._policy_losses(output)
        weighed = mask if self.weights is None else mask * self.weights.to(mask.dtype)
        total, normalizer = aggregate_sum(losses, weighed, self.settings.agg,
                                          self.settings.loss_scale_factor)
        self._pending[_NORMALIZER] = normalizer
        return total

    def settle(self, loss: torch.Tensor) -> float:
        """The forward's `loss` as a float, fetched with the normalizer and the values this
        loss computed in one transfer from the device (rather than one each)."""
        names = list(self._pending)
        fetched = torch.stack([loss.detach().reshape(()).to(torch.float64)] + [
            _double(self._pending[n], loss.device) for n in names]).tolist()
        got = dict(zip(names, fetched[1:]))
        if _NORMALIZER in got:
            self.normalizer = got.pop(_NORMALIZER)
        self.values.update(got)
        self._pending.clear()
        return fetched[0]

    def _policy_losses(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each response token's loss (B, R): the policy loss, plus kl_coef x the KL to the
        reference, minus entropy_coeff x the token's entropy."""
        s = self.settings
        dtype = torch.promote_types(logits.dtype, torch.float32)  # as _picked_logprobs's
        col = {k: v.to(dtype) for k, v in self.columns.items()}
        mask = self.mask.to(dtype)
        every = self._picked_logprobs(logits)  # (B, R, V)
        logp = every.gather(-1, self.tokens_at[..., None]).squeeze(-1)  # (B, R)
        losses = self._policy_term(logp, col, mask)
        if s.uses_reference:
            losses = losses + s.kl_coef * kl_penalty(logp, col["ref_logprobs"], s.kl_kind)
        if s.entropy_coeff:
            entropy = entropy_from_logprobs(every)
            losses = losses - s.entropy_coeff * entropy
        else:  # reported only: a response at a time, so the vocabulary-wide temporaries stay
            with torch.no_grad():  # one response's (B x R x V of them would double the peak)
                entropy = torch.stack([entropy_from_logprobs(row) for row in every])
        self._pending["entropy"] = _token_mean(entropy, mask)
        return losses, mask

    def _picked_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """The vocabulary's log-probabilities (B, R, V) where each response token was
        predicted, at the sampler's temperature, in float32 at least: a bf16 log-softmax is
        too coarse for a ratio that starts at 1."""
        dtype = torch.promote_types(logits.dtype, torch.float32)
        picked = logits[self.rows, self.positions]  # (B, R, V)
        temperature = self.settings.temperature if self.settings.temperature > 0 else 1.0
        return F.log_softmax(picked.to(dtype) / temperature, dim=-1)  # greedy records 1

    def _policy_term(self, logp: torch.Tensor, col: dict, mask: torch.Tensor) -> torch.Tensor:
        """The clipped policy loss per token. Against the records' log-probs (the sampler's,
        synchronous PPO), or, `proximal`, against this forward's own (detached: the weights
        before this update, AReaL's proximal policy, verl's recomputed old log-probs) with
        each token weighed by trainer / sampler probability: the decoupled objective's capped
        weight, or the rollout correction's."""
        s = self.settings
        old = logp.detach() if s.proximal else col["logprobs"]
        if s.policy_loss == "gspo":
            losses = gspo_token_losses(old, logp, col["advantages"], mask,
                                       _side(s.clip_ratio_low, s.clip_ratio),
                                       _side(s.clip_ratio_high, s.clip_ratio))
        else:
            losses, stats = ppo_token_losses_and_stats(
                old, logp, col["advantages"], mask, s.clip_ratio, s.clip_ratio_c,
                clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high)
            self._pending.update({"pg_clipfrac": stats["clipfrac"],
                                  "ppo_kl": stats["approx_kl"]})
        if not s.proximal:
            return losses
        return losses * self._sampler_weights(col["logprobs"], logp.detach(), mask)

    def _sampler_weights(self, behav: torch.Tensor, prox: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
        s = self.settings
        if s.rollout_is is None:  # the decoupled objective's: token level, capped
            stats = decoupled_weight_stats(behav, prox, mask, s.behav_cap)
            self._pending.update(stats)
            return behav_weights(behav, prox, s.behav_cap)[0]
        weights, metrics = rollout_is_weights(
            prox, behav, mask, level=s.rollout_is, mode=s.rollout_is_mode,
            threshold=s.rollout_is_threshold, threshold_lower=s.rollout_is_threshold_lower,
            veto_threshold=s.rollout_is_veto_threshold)
        self._pending.update(metrics)
        return weights

    def _value_losses(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(values.dtype, torch.float32)
        predicted = values[self.rows, self.positions].to(dtype)  # (B, R)
        col = {k: v.to(dtype) for k, v in self.columns.items()}
        losses = value_token_losses(predicted, col["returns"], col["values"],
                                    self.mask.to(dtype),
                                    clip_range=self.settings.cliprange_value)
        return losses, self.mask.to(dtype)

    def _check_output(self, output: torch.Tensor) -> None:
        if self.kind == "value" and output.dim() != 2:
            raise ValueError(f"loss 'value' reads one value per position from a critic (a GPT "
                             f"with value_head=True; set model_config value_head: true), but "
                             f"this model's last stage returned shape {tuple(output.shape)}")
        if self.kind == "policy" and output.dim() != 3:
            raise ValueError(f"loss {self.settings.loss!r} reads next-token logits (B, T, vocab), "
                             f"but this model's last stage returned shape "
                             f"{tuple(output.shape)}: a value head? train it with loss 'value'")


def _side(value: float | None, clip_ratio: float) -> float:
    return clip_ratio if value is None else value


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kept = torch.where(mask.bool(), values.detach(), torch.zeros_like(values))
    return kept.sum() / mask.sum()


_NORMALIZER = " normalizer"  # no value's name: a space


def _double(value: Any, device: torch.device) -> torch.Tensor:
    """A statistic (a 0-d tensor or a number) as a float64 0-d tensor on `device`: exact,
    as float(value) is."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def _check_agg(settings: RLSettings) -> None:
    """The aggregation settings, checked before any forward runs."""
    if settings.loss_agg_mode is not None and settings.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={settings.loss_agg_mode!r}; expected one of "
                         f"{', '.join(LOSS_AGG_MODES)}")
    if settings.agg == "seq-mean-token-sum-norm" and settings.loss_scale_factor is None:
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' divides each response's "
                         "summed loss by a constant: pass loss_scale_factor (the generation "
                         "budget, max_new_tokens)")


def _name(e: Any) -> str:
    return f"prompt_id={e.prompt_id} sample={e.sample}"


def _need_prompts(exps: list) -> None:
    for e in exps:
        if e.response_tokens and not e.prompt_tokens:
            raise ValueError(f"sample {_name(e)} has no prompt tokens: its first response token "
                             "has no position to be predicted from")


def _trained_mask(e: Any) -> list[int]:
    """1 for each response token the model sampled, 0 for an environment's."""
    mask = list(getattr(e, "response_mask", ()))
    if mask and (len(mask) != len(e.response_tokens) or not set(mask) <= {0, 1}):
        raise ValueError(f"sample {_name(e)} has a response_mask of {len(mask)} entries for "
                         f"{len(e.response_tokens)} response tokens; it must be one 0 or 1 each")
    return mask or [1] * len(e.response_tokens)


def _token_weights(e: Any, settings: RLSettings) -> list[float]:
    """Each response token's weight in the loss: the record's, each in (0, 1], or 1 each."""
    weights = list(getattr(e, "token_weights", ()))
    if not weights:
        return [1.0] * len(e.response_tokens)
    if len(weights) != len(e.response_tokens) or not all(
            isinstance(w, float) and 0.0 < w <= 1.0 for w in weights):
        raise ValueError(f"sample {_name(e)} has token_weights of {len(weights)} entries for "
                         f"{len(e.response_tokens)} response tokens; it must be one float in "
                         "(0, 1] each")
    if settings.agg == "seq-mean-token-mean":
        raise ValueError(f"sample {_name(e)} weighs its tokens (a tree rollout's shared prefix), "
                         "which seq-mean-token-mean's mean over each response would weigh "
                         "again: aggregate token-mean or seq-mean-token-sum-norm")
    return weights


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
