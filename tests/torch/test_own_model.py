"""A model that is not the built-in GPT generates and scores on real executor processes with
nothing but `forward(tokens)` [Note: generation and scoring interface in
executors/torch/rollout/lm.py]: no context length, no cache, so decoding recomputes every prefix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flowkit.ops.records import Prompt
from tests.harness import executor_cluster

# A causal model in a few lines: position t sees the mean of the embeddings of tokens 0..t.
_PLAIN_LM = '''
import torch


class PlainLM(torch.nn.Module):
    def __init__(self, vocab_size=16, width=8, value_head=False):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab_size, width)
        self.head = torch.nn.Linear(width, 1 if value_head else vocab_size)

    def forward(self, tokens):
        x = self.wte(tokens).cumsum(1)  # (B, T, width)
        x = x / torch.arange(1, tokens.size(1) + 1, device=x.device)[:, None]
        return self.head(torch.tanh(x)).squeeze(-1)  # logits (B, T, V), or values (B, T)
'''
CONFIG = {"vocab_size": 16, "width": 8}
PROMPTS = [Prompt(prompt_id=i, tokens=[(3 * i + j) % 16 for j in range(1 + 2 * i)])
           for i in range(4)]


def _spec(module: str, model: str, **config) -> dict:
    return {"model": model, "build": f"{module}:PlainLM", "model_config": {**CONFIG, **config},
            "dtype": "float64", "seed": 5}


def _here(path: Path, **config) -> torch.nn.Module:
    """The model as every holder builds it (seeded, float64), in this process."""
    spec = importlib.util.spec_from_file_location("plain_lm_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(5)
    return module.PlainLM(**{**CONFIG, **config}).double().eval()


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """Rollouts, their logprobs and a critic's values, each from an executor process that
    imports the model from the file's folder."""
    path = tmp_path_factory.mktemp("own") / "plain_lm.py"
    path.write_text(_PLAIN_LM)
    with executor_cluster(1, kind="torch", code=[path]) as (ctl, _):
        policy, critic = _spec("plain_lm", "policy"), _spec("plain_lm", "critic", value_head=True)
        rollouts = ctl.submit("generate", PROMPTS, config={**policy, "n": 2, "eos": None,
                                                           "max_new_tokens": 6, "max_batch": 3})
        scores = ctl.submit("logprobs", rollouts, config=policy)
        values = ctl.submit("values", rollouts, config=critic)
        return path, rollouts.result(timeout=60), scores.result(timeout=60), \
            values.result(timeout=60)


def test_a_forward_only_model_generates_to_max_new_tokens_without_a_context(remote):
    _, rollouts, _, _ = remote
    assert sorted((r.prompt_id, r.sample) for r in rollouts) == \
        [(p.prompt_id, k) for p in PROMPTS for k in range(2)]
    assert all(len(r.response_tokens) == 6 and not r.clipped and not r.finished
               for r in rollouts)


def test_its_sampler_logprobs_equal_the_op_and_a_recomputation_here(remote):
    path, rollouts, scores, _ = remote
    model = _here(path)
    for r, s in zip(rollouts, scores):
        seq = torch.tensor([r.prompt_tokens + r.response_tokens])
        with torch.no_grad():
            logp = F.log_softmax(model(seq[:, :-1])[0], dim=-1)  # (T - 1, V)
        p = len(r.prompt_tokens)
        recomputed = logp[torch.arange(p - 1, seq.size(1) - 1), seq[0, p:]].tolist()
        assert (s.prompt_id, s.sample) == (r.prompt_id, r.sample)
        assert r.logprobs == pytest.approx(recomputed, rel=0, abs=1e-12)
        assert s.values == pytest.approx(recomputed, rel=0, abs=1e-12)


def test_its_value_head_build_is_a_critic(remote):
    path, rollouts, _, values = remote
    critic = _here(path, value_head=True)
    for r, v in zip(rollouts, values):
        with torch.no_grad():
            alone = critic(torch.tensor([r.prompt_tokens + r.response_tokens]))[0]  # (T,)
        p = len(r.prompt_tokens)
        assert v.values == pytest.approx(alone[p - 1 : -1].tolist(), rel=0, abs=1e-12)
