"""The statistics a step reads from the device come in one transfer each, not one a tensor (on a
GPU each is a host sync): a stage's squared gradient norm, and an RL microbatch's loss with its
normalizer and values. The numbers are those a loop of float() gives, bit for bit."""

from __future__ import annotations

import pytest
import torch

from executors.torch.train.pipeline_ops import squared_norm
from executors.torch.train.rl_loss import RLLoss, RLSettings, sequence_ids
from tests.torch.test_decoupled_loss import CPU, _experiences, _model


@pytest.fixture
def transfers(monkeypatch):
    """Counts the device-to-host reads: tolist, and float()/item() of a tensor."""
    counted = {"tolist": 0, "float": 0, "item": 0}
    for name, method in (("tolist", "tolist"), ("float", "__float__"), ("item", "item")):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _name=name, _original=original):
            counted[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, method, counting)
    return counted


def _grads() -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(37, 11, generator=gen) * 1e3, None,
            torch.randn(5, generator=gen, dtype=torch.float64) * 1e-4,
            torch.randn(129, generator=gen).to(torch.bfloat16)]


def test_the_squared_norm_is_the_loops_in_one_transfer(transfers):
    grads = _grads()
    loop = sum(float(g.detach().double().pow(2).sum()) for g in grads if g is not None)
    for key in transfers:
        transfers[key] = 0
    assert squared_norm(grads) == loop  # bit for bit: the host adds the same floats in order
    assert transfers == {"tolist": 1, "float": 0, "item": 0}
    assert squared_norm([None]) == 0 and squared_norm([]) == 0


@pytest.mark.parametrize("settings", [
    RLSettings(loss="ppo"),
    RLSettings(loss="ppo", decoupled=True, behav_cap=2.0),
    RLSettings(loss="grpo", kl_coef=0.1, entropy_coeff=0.01),
    RLSettings(loss="ppo", rollout_is="token"),
], ids=["ppo", "decoupled", "grpo-kl-entropy", "rollout-is"])
def test_an_rl_microbatch_settles_its_statistics_in_one_transfer(settings, transfers):
    model = _model()
    exps = _experiences(model, 4, seed=3, staleness=0.5)
    loss = RLLoss(exps, [], settings, CPU)
    with torch.no_grad():
        out = loss(model(sequence_ids(exps, CPU)))
    for key in transfers:
        transfers[key] = 0
    pending = dict(loss._pending)
    assert loss.settle(out) == out.item()
    assert transfers == {"tolist": 1, "float": 0, "item": 1}  # the item() is this test's
    expected = {k: float(v) for k, v in pending.items()}
    assert loss.normalizer == expected.pop(" normalizer") > 0
    assert loss.values == expected and "entropy" in expected
    assert loss.tokens == sum(len(e.response_tokens) for e in exps)


def test_a_microbatch_with_nothing_to_train_settles_to_zeros():
    model = _model()
    exps = [e for e in _experiences(model, 4, seed=3) if not e.response_tokens]
    loss = RLLoss(exps, [], RLSettings(loss="ppo"), CPU)
    with torch.no_grad():
        out = loss(model(sequence_ids(exps, CPU)))
    assert loss.settle(out) == 0.0 and loss.normalizer == 0.0 and loss.values == {}
