"""Deferred LayerNorm and Embedding weight gradients, in every form those layers take, against
plain autograd; and the reason they are deferred: a stage built of them keeps no graph to W."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from executors.torch import StageRunner
from executors.torch.models.gpt import split_gpt
from tests.harness import seeded_gpt, tiny_gpt

D, VOCAB = 6, 9


class _Norms(nn.Module):
    """LayerNorms with and without a bias or affine parameters, and a functional call whose
    weight is the stage's but whose bias is not a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.full = nn.LayerNorm(D)
        self.no_bias = nn.LayerNorm(D, bias=False)
        self.plain = nn.LayerNorm(D, elementwise_affine=False)
        self.over_two = nn.LayerNorm((3, D))  # normalized over the last two dimensions
        self.scale = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x):
        h = self.no_bias(torch.tanh(self.full(x)))
        h = self.plain(h) * 2 + self.over_two(h)
        h = F.layer_norm(h, (D,), weight=self.scale, bias=torch.ones(D, dtype=h.dtype), eps=1e-3)
        return (h**2).mean()


class _Embeds(nn.Module):
    """Embeddings with padding (positive and negative), scaled by frequency, with max_norm
    and sparse (those two stay with the generic split), one table used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.pad = nn.Embedding(VOCAB, D, padding_idx=2)
        self.neg_pad = nn.Embedding(VOCAB, D, padding_idx=-1)
        self.freq = nn.Embedding(VOCAB, D, scale_grad_by_freq=True)
        self.capped = nn.Embedding(VOCAB, D, max_norm=1.0)
        self.sparse = nn.Embedding(VOCAB, D, sparse=True)

    def forward(self, ids):
        h = self.pad(ids) + self.neg_pad(ids) * self.freq(ids) + self.pad(ids.flip(-1))
        h = h + self.capped(ids) + self.sparse(ids)
        return (torch.tanh(h) ** 2).mean()


class _Scales(nn.Module):
    """Per-channel scales as RMSNorms apply them (``weight * x`` and ``x * weight``, through
    the operator and torch.mul), one used twice, beside a 2-D parameter product that is not a
    scale (the generic split) and a scale of a non-parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)
        self.beta = nn.Parameter(torch.rand(D) + 0.5)
        self.square = nn.Parameter(torch.rand(3, D))

    def forward(self, x):
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.gamma * rms + torch.mul(torch.tanh(rms), self.beta) * self.gamma
        h = h * self.square + h * torch.ones(D, dtype=h.dtype)
        return (h**2).mean()


def test_per_channel_scales_are_deferred_and_leave_no_consumer():
    stage = _Scales().double()
    runner = StageRunner(stage)
    runner.forward(0, torch.randn(2, 3, D, dtype=torch.float64))
    kinds = [type(c).__name__ for c in runner._mbs[0].calls]
    assert kinds.count("ScaleCall") == 3  # gamma twice, beta once; not square, not the ones


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 3, 5), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "make, data",
    [
        (_Norms, lambda: torch.randn(2, 3, D, dtype=torch.float64)),
        (_Embeds, _ids),
        (_Scales, lambda: torch.randn(2, 3, D, dtype=torch.float64)),
    ],
    ids=["layer_norm", "embedding", "scale"],
)
def test_weight_grads_wait_for_w_and_match_autograd(make, data):
    torch.manual_seed(0)
    stage = make().double()
    ref = copy.deepcopy(stage)
    x = data()
    ref(x).backward()
    runner = StageRunner(stage)
    runner.forward(0, x)
    runner.backward_input(0)
    assert all(p.grad is None for p in stage.parameters())
    runner.backward_weight(0)
    for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
        diff = (p.grad - q.grad).abs().max() if not q.grad.is_sparse else \
            (p.grad.to_dense() - q.grad.to_dense()).abs().max()
        assert diff < 1e-12, name


class _Saves(torch.autograd.Function):
    """Identity that saves its input for the backward, as most autograd nodes do; `seen` holds
    a weak reference to it."""

    seen: list[weakref.ref] = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        _Saves.seen.append(weakref.ref(x))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def test_a_gpt_stage_frees_its_activations_during_b():
    """Every parameter of a GPT stage sits in a linear, layer-norm or embedding layer, so no
    graph is kept from B to W: what only autograd saved is gone after B (here an activation
    between ln_1 and ln_2; a kept ln_2 node would hold it, and everything else below it)."""
    first, _ = split_gpt(seeded_gpt(tiny_gpt(vocab_size=32, block_size=8, n_embd=16)), 2)
    first.h[0].attn.c_proj.register_forward_hook(lambda m, i, o: _Saves.apply(o))
    _Saves.seen.clear()
    runner = StageRunner(first)
    out = runner.forward(0, torch.randint(0, 32, (2, 8)))
    gc.collect()
    assert _Saves.seen[0]() is not None  # the graph holds it for the backward
    runner.backward_input(0, torch.ones_like(out))
    gc.collect()
    assert _Saves.seen[0]() is None
    runner.backward_weight(0)
    assert all(p.grad is not None for p in first.parameters())
