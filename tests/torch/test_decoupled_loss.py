"""AReaL's decoupled PPO objective (Fu et al. 2025) for samples of older weights: the clipped
ratio against the proximal policy (this forward pass, detached), times the capped importance
weight prox / behav. In float64: against plain PPO where the two must agree (fresh samples),
and against a hand-written gradient where they must not (stale ones)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.torch.models.gpt import GPT
from executors.torch.train.rl_loss import RLLoss, RLSettings, sequence_ids
from flowkit.ops import LOSS_KNOBS
from flowkit.ops.records import Experience
from tests.harness import seeded_gpt, tiny_gpt
from tests.rl.reference_algos import (
    AGG_MODES,
    decoupled_ppo_policy_loss,
    decoupled_weight_stats,
    ppo_policy_loss,
)

F64 = torch.float64
TIGHT = 1e-10
FAST = settings(max_examples=30, deadline=None)
CPU = torch.device("cpu")


# -- random padded batches --------------------------------------------------------------------
@st.composite
def batches(draw) -> dict:
    """Seeds and shapes of a (B, T) batch whose mask has at least one real token (and may have
    fully padded rows, which the seq-mean modes skip)."""
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    keep = draw(st.lists(st.booleans(), min_size=rows * width, max_size=rows * width))
    keep[draw(st.integers(0, rows * width - 1))] = True
    mask = torch.tensor(keep, dtype=F64).reshape(rows, width)
    return {"mask": mask, "seed": draw(st.integers(0, 2**16)), "vocab": draw(st.integers(2, 7))}


def _tensors(batch: dict, staleness: float) -> dict:
    """logits (B, T, V) to differentiate, the tokens' log-probs under them, advantages, and
    behaviour log-probs `staleness` (a Gaussian scale) away from the current ones."""
    g = torch.Generator().manual_seed(batch["seed"])
    rows, width = batch["mask"].shape
    logits = torch.randn(rows, width, batch["vocab"], generator=g, dtype=F64).requires_grad_()
    tokens = torch.randint(batch["vocab"], (rows, width), generator=g)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    noise = torch.randn(rows, width, generator=g, dtype=F64) * staleness
    return {"logits": logits, "tokens": tokens, "logp": logp,
            "advantages": torch.randn(rows, width, generator=g, dtype=F64),
            "behav": logp.detach() + noise}


def _agg_weights(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """d(aggregate)/d(per-token loss), (B, T), as verl's agg_loss weighs each token."""
    counts = mask.sum(dim=-1, keepdim=True)
    rows = (counts > 0).to(F64).sum()
    if agg == "token-mean":
        return mask / mask.sum()
    if agg == "seq-mean-token-mean":
        return mask / (counts + 1e-8) / rows
    if agg == "seq-mean-token-sum-norm":  # over the padded width, the constant's default
        return mask / rows / mask.shape[-1]
    return mask / rows  # seq-mean-token-sum


# -- the objective alone ----------------------------------------------------------------------
@FAST
@given(batch=batches(), agg=st.sampled_from(AGG_MODES), staleness=st.floats(0.0, 1.0),
       clip=st.floats(0.05, 0.5))
def test_with_fresh_samples_the_decoupled_loss_and_gradient_are_ppos(batch, agg, staleness,
                                                                      clip):
    # behav == prox: every weight is exp(0) == 1, so nothing may differ, not even rounding;
    # prox is the older weights here (staleness), so the ratio and its clip are exercised
    t = _tensors(batch, staleness)
    old = t["behav"]
    args = (t["logp"], t["advantages"], batch["mask"])
    plain = ppo_policy_loss(old, *args, clip_ratio=clip, agg=agg)
    (plain_grad,) = torch.autograd.grad(plain, t["logits"], retain_graph=True)
    decoupled = decoupled_ppo_policy_loss(old, old.clone(), *args, clip_ratio=clip, agg=agg)
    (decoupled_grad,) = torch.autograd.grad(decoupled, t["logits"])
    assert torch.equal(decoupled, plain)
    assert torch.equal(decoupled_grad, plain_grad)


@FAST
@given(batch=batches(), agg=st.sampled_from(AGG_MODES), staleness=st.floats(0.0, 3.0),
       cap=st.floats(1.0, 10.0))
def test_the_gradient_is_minus_the_capped_weight_times_the_advantage_times_grad_logp(
        batch, agg, staleness, cap):
    # prox = detach(logp): the ratio is 1 in value, inside the clip, so per token the loss is
    # -w * A * r and its gradient -w * A * grad log pi, with grad_logits log pi = onehot - p
    t = _tensors(batch, staleness)
    mask = batch["mask"]
    loss = decoupled_ppo_policy_loss(t["behav"], t["logp"].detach(), t["logp"],
                                     t["advantages"], mask, behav_cap=cap, agg=agg)
    (grad,) = torch.autograd.grad(loss, t["logits"])

    weights = torch.clamp(torch.exp(t["logp"].detach() - t["behav"]), max=cap)
    per_token = -weights * t["advantages"] * _agg_weights(mask, agg)  # d loss / d logp
    probs = torch.softmax(t["logits"].detach(), dim=-1)
    onehot = torch.nn.functional.one_hot(t["tokens"], batch["vocab"]).to(F64)
    expected = per_token[..., None] * (onehot - probs)
    assert (grad - expected).abs().max().item() < TIGHT
    assert loss.item() == pytest.approx(per_token.sum().item(), abs=TIGHT)


def test_weights_above_the_cap_get_exactly_the_cap():
    cap = 5.0
    log_weights = torch.tensor([[math.log(10.0), math.log(2.0), 0.0, math.log(0.5),
                                 math.log(7.0), 30.0]], dtype=F64)  # 30: past the +-20 clamp
    logp = torch.full_like(log_weights, -1.3, requires_grad=True)
    behav = logp.detach() - log_weights
    mask = torch.ones_like(logp)
    # one row, token-sum, A = 1: d loss / d logp_t is exactly -w_t (ratio 1, no division)
    loss = decoupled_ppo_policy_loss(behav, logp.detach(), logp, torch.ones_like(logp), mask,
                                     behav_cap=cap, agg="seq-mean-token-sum")
    (grad,) = torch.autograd.grad(loss, logp)
    weights = -grad[0]
    assert weights[[0, 4, 5]].tolist() == [cap, cap, cap]
    assert weights[[1, 2, 3]].tolist() == pytest.approx([2.0, 1.0, 0.5], abs=1e-14)

    stats = decoupled_weight_stats(behav, logp.detach(), mask, behav_cap=cap)
    assert stats["behav_weight_mean"].item() == pytest.approx(weights.mean().item(), abs=1e-14)
    assert stats["behav_capfrac"].item() == 0.5


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_a_cap_that_is_not_positive_is_refused(cap):
    x = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"behav_cap is .*, expected > 0"):
        decoupled_ppo_policy_loss(x, x, x, x, torch.ones_like(x), behav_cap=cap)
    with pytest.raises(ValueError, match=r"behav_cap is .*, expected > 0"):
        decoupled_weight_stats(x, x, torch.ones_like(x), behav_cap=cap)
    with pytest.raises(ValueError, match=r"behav_cap is .*, expected > 0"):
        RLSettings.from_config("ppo", {"decoupled": True, "behav_cap": cap})


# -- the settings -----------------------------------------------------------------------------
def test_settings_pick_up_the_decoupled_knobs_and_default_to_synchronous_ppo():
    plain = RLSettings(loss="ppo")
    assert (plain.decoupled, plain.behav_cap) == (LOSS_KNOBS["decoupled"], LOSS_KNOBS["behav_cap"])
    assert plain.decoupled is False
    settings_ = RLSettings.from_config("grpo", {"decoupled": True, "behav_cap": 2, "lr": 1e-3,
                                                "clip_ratio": 0.1})
    assert (settings_.decoupled, settings_.behav_cap, settings_.clip_ratio) == (True, 2.0, 0.1)
    assert isinstance(settings_.behav_cap, float)


def test_a_decoupled_switch_that_is_not_a_bool_is_refused():
    # "false" would read as on under bool()
    with pytest.raises(TypeError, match="decoupled"):
        RLSettings.from_config("ppo", {"decoupled": "false"})


# -- through RLLoss, the last stage's loss ----------------------------------------------------
def _model() -> GPT:
    return seeded_gpt(tiny_gpt(), seed=5, dtype=F64)


def _own_logprobs(model: GPT, prompt: list[int], response: list[int]) -> list[float]:
    """The model's log-probability of each response token, the sample alone in its batch."""
    if not response:
        return []
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(seq[:, :-1])[0, len(prompt) - 1:]
    own = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])
    return own.squeeze(-1).tolist()


def _experiences(model: GPT, count: int, seed: int, *, staleness: float = 0.0
                 ) -> list[Experience]:
    """Random samples (one with an empty response) whose logprobs, the behaviour policy's, are
    the model's own plus Gaussian noise of scale `staleness`."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 6))]
        response = [rng.randrange(64) for _ in range(0 if i == 1 else rng.randint(1, 8))]
        own = _own_logprobs(model, prompt, response)
        out.append(Experience(
            prompt_id=seed * 100 + i, sample=0, prompt_tokens=prompt, response_tokens=response,
            logprobs=[v + rng.gauss(0.0, staleness) for v in own],
            reward=rng.random(), advantages=[rng.gauss(0.0, 1.0) for _ in response],
            ref_logprobs=[v + rng.gauss(0.0, 0.3) for v in own]))
    return out


def _loss_and_grads(model: GPT, exps: list[Experience], settings_: RLSettings) -> tuple:
    """The microbatch's summed loss through RLLoss and the model's gradient of it."""
    model.zero_grad()
    loss = RLLoss(exps, [], settings_, CPU)(model(sequence_ids(exps, CPU)))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss, kl_coef", [("ppo", 0.0), ("grpo", 0.1)])
def test_rl_loss_on_fresh_samples_is_the_same_decoupled_or_not(loss, kl_coef):
    # samples of the weights being trained: behav == prox up to rounding, weights 1, and the
    # decoupled ratio (against detach(logp)) matches the plain one (against the records')
    model = _model()
    exps = _experiences(model, 5, seed=3)
    knobs = {"kl_coef": kl_coef}
    plain_loss, plain_grads = _loss_and_grads(model, exps, RLSettings(loss=loss, **knobs))
    loss_, grads = _loss_and_grads(model, exps, RLSettings(loss=loss, decoupled=True, **knobs))
    assert loss_ == pytest.approx(plain_loss, abs=TIGHT)
    for name, g in grads.items():
        diff = (g - plain_grads[name]).abs().max().item()
        assert diff < TIGHT, f"{name}: gradient differs by {diff:.3g}"


def test_rl_loss_on_stale_samples_is_the_weighted_policy_gradient():
    # the records' logprobs are another policy's: RLLoss must use them as the behaviour
    # log-probs only, so the sum is -sum_t w_t * A_t at ratio 1 (plus nothing: no KL)
    model = _model()
    exps = _experiences(model, 5, seed=4, staleness=1.0)
    cap = 2.0
    rl = RLLoss(exps, [], RLSettings(loss="ppo", decoupled=True, behav_cap=cap), CPU)
    with torch.no_grad():
        total = rl(model(sequence_ids(exps, CPU))).item()
    expected = 0.0
    for e in exps:
        own = _own_logprobs(model, e.prompt_tokens, e.response_tokens)
        for behav, prox, a in zip(e.logprobs, own, e.advantages):
            expected -= min(math.exp(prox - behav), cap) * a
    assert total == pytest.approx(expected, abs=TIGHT)
    plain = RLLoss(exps, [], RLSettings(loss="ppo"), CPU)
    with torch.no_grad():
        assert plain(model(sequence_ids(exps, CPU))).item() != pytest.approx(expected, abs=1e-3)

