"""Small models cut into stages, valid F/B/W orders, and a driver that runs them on StageRunners.

A stage here is a `Chain`: layers applied in turn; the last stage also takes the microbatch's
targets and returns the loss, as the GPT stages do (see [Note: GPT stage inputs]).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Collection, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from executors.torch import StageRunner
from flowkit.planner.ir import Action, Costs, Kind
from flowkit.planner.schedules import build_schedule

D = 6  # feature width of every toy model: small, so the whole suite stays fast


class Chain(nn.Module):
    def __init__(self, layers: Sequence[nn.Module], loss: Callable | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.loss = loss

    def forward(self, x, target=None):
        for layer in self.layers:
            x = layer(x)
        return x if self.loss is None else self.loss(x, target)


class Residual(nn.Module):
    """x + Linear(GELU(LayerNorm(x))): the pre-norm MLP shape of a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class ScaleTwice(nn.Module):
    """A plain parameter used twice with a linear layer between its uses, and that linear layer
    applied twice: both must sum their contributions."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(D) + 0.5)
        self.mix = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.mix(x * self.scale))
        return self.mix(h) * self.scale + x


class Conv(nn.Module):
    """A convolution over time on (B, T, C) activations."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(D, D, kernel_size=3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x.transpose(1, 2)).transpose(1, 2))


def _mse(x, target):
    return F.mse_loss(x, target)


def _cross_entropy(x, target):
    return F.cross_entropy(x.reshape(-1, x.size(-1)), target.reshape(-1))


VOCAB = 11


def _layers(kind: str) -> tuple[list[nn.Module], Callable]:
    if kind == "linear":
        return [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)], _mse
    if kind == "mlp_ln":
        return [Residual() for _ in range(4)] + [nn.LayerNorm(D)], _mse
    if kind == "embed_conv":
        return [nn.Embedding(VOCAB, D), Conv(), Residual(), Conv(), nn.Linear(D, VOCAB)], \
            _cross_entropy
    if kind == "shared":
        return [ScaleTwice(), Residual(), ScaleTwice(), ScaleTwice()], _mse
    raise ValueError(kind)


KINDS = ("linear", "mlp_ln", "embed_conv", "shared")


def make_stages(kind: str, stages: int, seed: int = 0) -> list[Chain]:
    torch.manual_seed(seed)
    layers, loss = _layers(kind)
    bounds = [round(i * len(layers) / stages) for i in range(stages + 1)]
    return [
        Chain(layers[bounds[s] : bounds[s + 1]], loss if s == stages - 1 else None).double()
        for s in range(stages)
    ]


def make_data(kind: str, microbatches: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """(input, target) per microbatch, both (B, T, ...) with B=2, T=5."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(microbatches):
        if kind == "embed_conv":
            x = torch.randint(0, VOCAB, (2, 5), generator=g)
            y = torch.randint(0, VOCAB, (2, 5), generator=g)
        else:
            x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
            y = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
        data.append((x, y))
    return data


def reference_grads(stages: list[nn.Module], data) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """Plain autograd of the summed microbatch losses, on a copy of the stages."""
    ref = copy.deepcopy(stages)
    total = 0.0
    for x, y in data:
        for s, stage in enumerate(ref):
            x = stage(x, y) if s == len(ref) - 1 else stage(x)
        total = total + x
    total.backward()
    return float(total.detach()), [
        {n: p.grad.clone() for n, p in st.named_parameters() if p.grad is not None} for st in ref
    ]


def schedule_order(kind: str, stages: int, microbatches: int) -> list[Action]:
    """One global order of a planner schedule's actions that respects its dependencies."""
    devices = stages // 2 if kind == "zb-v" else stages
    costs = Costs(F=[1.0] * devices, B=[1.0] * devices, W=[1.0] * devices)
    sched = build_schedule(kind, devices=devices, microbatches=microbatches, costs=costs)
    assert sched.num_stages == stages
    queues = [list(ops) for ops in sched.device_ops]
    done: set[tuple[int, str, int]] = set()
    order: list[Action] = []
    while any(queues):
        progressed = False
        for q in queues:
            if q and _ready(q[0], done, stages):
                order.append(q.pop(0))
                done.add(_key(order[-1]))
                progressed = True
        assert progressed, "schedule order is stuck"
    return order


def _key(a: Action) -> tuple[int, str, int]:
    kind = "B" if a.kind in (Kind.B, Kind.BW) else a.kind.value
    return (a.stage, kind, a.microbatch)


def _ready(a: Action, done: set, stages: int) -> bool:
    s, m = a.stage, a.microbatch
    if a.kind == Kind.F:
        return s == 0 or (s - 1, "F", m) in done
    if a.kind == Kind.W:
        return (s, "B", m) in done
    return (s, "F", m) in done and (s == stages - 1 or (s + 1, "B", m) in done)


def random_order(stages: int, microbatches: int, rnd: random.Random) -> list[Action]:
    """A random valid order; each (stage, microbatch) takes B then W, or the fused BW."""
    fused = {(s, m): rnd.random() < 0.3 for s in range(stages) for m in range(microbatches)}
    todo = [Action(s, Kind.F, m) for s in range(stages) for m in range(microbatches)]
    for (s, m), f in fused.items():
        todo += [Action(s, Kind.BW, m)] if f else [Action(s, Kind.B, m), Action(s, Kind.W, m)]
    done: set[tuple[int, str, int]] = set()
    order = []
    while todo:
        ready = [a for a in todo if _ready(a, done, stages)]
        a = rnd.choice(ready)
        todo.remove(a)
        order.append(a)
        done.add(_key(a))
    return order


class Driver:
    """Drives `runners` action by action; activations and gradients pass by hand between them,
    as the runtime's data plane would carry them."""

    def __init__(self, runners: list[StageRunner], data, *, split: bool = True,
                 offload: Collection[tuple[int, int]] = ()) -> None:
        self.runners, self.data, self.split = runners, data, split
        self.offload = set(offload)  # (stage, microbatch) whose forward offloads
        self.acts: dict[tuple[int, int], object] = {(0, m): x for m, (x, _) in enumerate(data)}
        self.grads: dict[tuple[int, int], object] = {}
        self.loss = 0.0

    def step(self, a: Action) -> None:
        s, m, runner = a.stage, a.microbatch, self.runners[a.stage]
        last = len(self.runners) - 1
        if a.kind == Kind.F:
            extra = (self.data[m][1],) if s == last else ()
            out = runner.forward(m, self.acts.pop((s, m)), *extra, split=self.split,
                                 offload=(s, m) in self.offload)
            if s == last:
                self.loss += float(out)
            else:
                self.acts[(s + 1, m)] = out
        elif a.kind == Kind.W:
            runner.backward_weight(m)
        elif a.kind == Kind.P:
            runner.prefetch(m)
        elif a.kind == Kind.O:
            assert runner.offloaded(m)  # its forward offloaded at once [Note: offloaded stash]
        else:
            upstream = () if s == last else (self.grads.pop((s, m)),)
            op = runner.backward if a.kind == Kind.BW else runner.backward_input
            gin = op(m, *upstream)
            if s > 0:
                self.grads[(s - 1, m)] = gin[0]


def run_order(runners: list[StageRunner], data, order: Sequence[Action], *,
              split: bool = True) -> float:
    """Run every action of `order` (forwards that do not `split` the backward: [Note: a fused
    backward]); returns the summed loss."""
    driver = Driver(runners, data, split=split)
    for a in order:
        driver.step(a)
    return driver.loss


def assert_grads_equal(stages: list[nn.Module], expected: list[dict], tol: float = 1e-10) -> None:
    for s, (stage, exp) in enumerate(zip(stages, expected)):
        for name, p in stage.named_parameters():
            assert p.grad is not None, f"stage {s} {name}: no gradient"
            diff = (p.grad - exp[name]).abs().max().item()
            assert diff < tol, f"stage {s} {name}: max abs diff {diff}"


# -- plain references of the RL losses: the unsplit model over one padded batch ---------------
def padded_batch(exps, fields: list[str]) -> tuple:
    """ids (B, T) and per response token (B, R): positions, tokens, mask and each field of the
    Experiences `exps`."""
    seqs = [e.prompt_tokens + e.response_tokens for e in exps]
    width = max(len(s) for s in seqs) - 1
    ids = torch.tensor([s[:-1] + [0] * (width - len(s) + 1) for s in seqs])
    r = max(len(e.response_tokens) for e in exps)

    def rows(per_exp, dtype=torch.float64):
        return torch.tensor([list(v) + [0] * (r - len(v)) for v in per_exp], dtype=dtype)

    positions = rows([[len(e.prompt_tokens) - 1 + k for k in range(len(e.response_tokens))]
                      for e in exps], torch.long)
    tokens = rows([e.response_tokens for e in exps], torch.long)
    mask = rows([[1.0] * len(e.response_tokens) for e in exps])
    return ids, positions, tokens, mask, {f: rows([getattr(e, f) for e in exps])
                                          for f in fields}


def response_logprobs(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                      tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, R) log-probabilities of the response tokens under `model`, as the sampler takes
    them: log_softmax(logits / temperature)."""
    logits = model(ids)  # (B, T, V)
    picked = logits.gather(1, positions[..., None].expand(-1, -1, logits.size(-1)))
    return torch.log_softmax(picked / temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]


# -- a model whose cache leaves out optional methods of the cache protocol --------------------
def with_cache_lacking(model: nn.Module, *missing: str) -> nn.Module:
    """`model` (one with the cache protocol of executors/torch/rollout/lm.py) whose caches
    lack the optional methods `missing` (copy_prefix, grown): the engine's paths without them."""

    class Cache:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name: str):
            if name in missing:
                raise AttributeError(name)
            return getattr(self.inner, name)

    class Wrapped(nn.Module):
        context_length = model.context_length

        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, idx):
            return self.inner(idx)

        def new_cache(self, batch, max_len):
            return Cache(self.inner.new_cache(batch, max_len))

        def forward_cached(self, idx, cache, start, rows=None):
            return self.inner.forward_cached(idx, cache.inner, start, rows)

    return Wrapped()


def run_microbatches(ctx, spec: dict, microbatches: list[tuple], *, stages: int,
                     loss_scale: float = 1.0, **loss_config) -> list:
    """F, B, W of each microbatch (a tuple of the F's data inputs) through every stage of the
    stage ops on one executor's context `ctx`; each microbatch's last-stage stats."""
    from executors.torch.train import pipeline_ops

    config = {**spec, "stages": stages, "loss_scale": loss_scale, **loss_config}
    stats = []
    for mb, data in enumerate(microbatches):
        x = None
        for s in range(stages):
            inputs = data if s == 0 else (x, *data) if s == stages - 1 else (x,)
            x = pipeline_ops._forward(ctx, *inputs, stage=s, microbatch=mb, **config)
        stats.append(x)
        grad = None
        for s in reversed(range(stages)):
            grad = pipeline_ops._backward_input(ctx, grad, stage=s, microbatch=mb, **config)
            pipeline_ops._backward_weight(ctx, stage=s, microbatch=mb, **config)
    return stats


def assert_same_training(want: dict, got: dict, want_reports: list, got_reports: list) -> None:
    """Two runs trained the same: every saved tensor (`{file: {key: tensor}}`) within 1e-9,
    every step's losses within 1e-12."""
    import pytest

    assert want.keys() == got.keys() and want
    for file, weights in want.items():
        for key, tensor in weights.items():
            diff = (got[file][key] - tensor).abs().max().item()
            assert diff < 1e-9, f"{file} {key}: differs by {diff:.3g}"
    for wanted, gotten in zip(want_reports, got_reports):
        losses = [key for key in wanted.metrics if key.endswith("/loss")]
        assert losses
        for key in losses:
            assert gotten.metrics[key] == pytest.approx(wanted.metrics[key], abs=1e-12), key
