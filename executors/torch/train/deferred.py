"""How B leaves weight gradients for W without running anything twice.

The design: [Note: deferred weight gradients] below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, Node
from torch.overrides import TorchFunctionMode

__all__ = ["Consumers", "DeferredCall", "EmbeddingCall", "LayerNormCall", "LinearCall", "Recorder",
           "SavedBytes", "ScaleCall", "accumulate", "consumer_nodes", "consumer_weight_grads",
           "edges_of",
           "grad_accumulator", "storages"]


# [Note: deferred weight gradients] B (`StageRunner.backward_input`) and W
# (`StageRunner.backward_weight`) split one backward pass. Every `F.linear`, `F.layer_norm`,
# `F.embedding` and per-channel scale (``weight * x``) of the stage's parameters runs through a
# deferred autograd Function whose backward computes the input gradient only; the recorder keeps
# what the weight part needs (the input as a detached alias, a LayerNorm's mean and 1/std), B
# captures dY and W computes dW = dYᵀX, db = ΣdY (or the kernel's weight outputs). Any other
# parameter: B captures the gradient entering each autograd node that takes it directly (its
# consumer) and keeps the graph; W runs each consumer once, as `torch.distributed.pipelining`
# does; a node sharing a parameter with another consumer is called directly so it is not counted
# twice. Why defer the common layers: a kept graph holds every saved activation until W, so B
# could not free as it goes; a stage with no consumers (every GPT stage) releases its graph like
# a plain backward. Neither half re-runs the forward, and W's sum is the ordinary gradient (tied
# weights get both parts). `flowkit bench train` times B + W against a fused backward. In full:
# docs/training.md, "How B and W split a backward".


def _check_unchanged(t: torch.Tensor, version: int) -> None:
    if t._version != version:
        raise RuntimeError(
            "the input of a linear, layer_norm or embedding layer was modified in place after "
            "the forward; deferred weight gradients need it unchanged (use an out-of-place op "
            "in the model)")


@attrs.define(eq=False)
class DeferredCall:
    """One deferred layer call of a microbatch: B sets `dy`, W calls `weight_grads`."""

    node: Node | None  # the deferred backward node; B captures dY at its edge 0, then drops it
    x: torch.Tensor  # layer input (ids for an embedding), detached alias of the forward's own
    x_version: int  # in-place edits of X after the forward would make W silently wrong
    dy: torch.Tensor | None = attrs.field(default=None, kw_only=True)

    def weight_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, gradient) pairs of this call, from X and dY."""
        raise NotImplementedError

    def held(self) -> list[torch.Tensor]:
        """The tensors kept for W (for stash accounting)."""
        return [self.x, self.dy] if self.dy is not None else [self.x]

    def params(self) -> list[torch.Tensor]:
        """The tensors weight_grads may give gradients for: every call kind keeps them as
        `weight` and `bias` (a frozen one too: more than it gives is safe to name)."""
        found = (getattr(self, "weight", None), getattr(self, "bias", None))
        return [p for p in found if isinstance(p, torch.Tensor)]


def _wants(param: torch.Tensor | None) -> bool:
    return param is not None and param.requires_grad


@attrs.define(eq=False)
class LinearCall(DeferredCall):
    weight: torch.Tensor
    bias: torch.Tensor | None

    def weight_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """dW = dYᵀX and db = ΣdY, summed over every leading (batch, time) dimension as one mm
        over the flattened tokens."""
        _check_unchanged(self.x, self.x_version)
        dy = self.dy.reshape(-1, self.dy.shape[-1])  # (N, out)
        x = self.x.reshape(-1, self.x.shape[-1])  # (N, in)
        out = [(self.weight, dy.t().mm(x.to(dy.dtype)))]  # (out, in)
        if _wants(self.bias):
            out.append((self.bias, dy.sum(0)))
        return out


@attrs.define(eq=False)
class LayerNormCall(DeferredCall):
    shape: list[int]
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    mean: torch.Tensor | None = None  # set by the forward: the statistics W reuses
    rstd: torch.Tensor | None = None

    def weight_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        _check_unchanged(self.x, self.x_version)
        mask = [False, _wants(self.weight), _wants(self.bias)]
        _, dw, db = torch.ops.aten.native_layer_norm_backward(
            self.dy, self.x, self.shape, self.mean, self.rstd, self.weight, self.bias, mask)
        return [(p, g) for p, g in ((self.weight, dw), (self.bias, db)) if g is not None]

    def held(self) -> list[torch.Tensor]:
        return [*super().held(), self.mean, self.rstd]


@attrs.define(eq=False)
class EmbeddingCall(DeferredCall):
    weight: torch.Tensor
    padding_idx: int  # normalized as the kernel takes it: -1 for none
    scale_grad_by_freq: bool

    def weight_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        _check_unchanged(self.x, self.x_version)
        dw = torch.ops.aten.embedding_dense_backward(self.dy, self.x, self.weight.shape[0],
                                                     self.padding_idx, self.scale_grad_by_freq)
        return [(self.weight, dw)]


@attrs.define(eq=False)
class ScaleCall(DeferredCall):
    """A per-channel scale ``x * weight`` (weight 1-D over x's last dimension): an RMSNorm's
    weight, as Hugging Face models apply it."""

    weight: torch.Tensor

    def weight_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        _check_unchanged(self.x, self.x_version)
        channels = self.weight.shape[0]
        dw = (self.dy * self.x.to(self.dy.dtype)).reshape(-1, channels).sum(0)
        return [(self.weight, dw)]


# [Note: deferred calls under autocast] Under bf16 mixed precision the stage's forward runs in
# torch.autocast over fp32 weights (executors/torch/train/stage.py). The recorder sees each
# layer before autocast does, so it does autocast's part itself: a linear runs on X and W cast
# to the autocast dtype (X's cast stays in the graph, so dX reaches an fp32 X as fp32), B's dX
# uses the cast W, and W's dW = dYᵀX comes out in bf16 and is accumulated into the fp32 `.grad`
# (`accumulate` casts), as autograd's cast node would; a layer norm runs in its (fp32) weight's
# dtype, as CUDA's autocast runs it. So the split B/W equals the fused backward under autocast
# (tests/torch/test_precision.py).
def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on x's device; None where autocast is off."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


class _DeferredLinear(torch.autograd.Function):
    """`F.linear` whose backward yields the input gradient only; W does the weight part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        # dX needs W only (X itself lives in the LinearCall): the parameter, not a cast copy a
        # microbatch would hold until its B [Note: deferred calls under autocast]
        ctx.save_for_backward(weight)
        low = _autocast_dtype(x)  # X comes cast already, W and b are cast here
        return F.linear(x, _cast(weight, low), _cast(bias, low))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        weight = _cast(weight, dy.dtype)  # as autocast cast it in the forward
        dx = dy.reshape(-1, dy.shape[-1]).mm(weight)  # (N, out) @ (out, in): one BLAS call
        return dx.view(*dy.shape[:-1], weight.shape[-1]), None, None


class _DeferredLayerNorm(torch.autograd.Function):
    """`F.layer_norm` whose backward yields the input gradient only; the statistics go to the
    `LayerNormCall` so that W needs no second pass over X."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, call: LayerNormCall, eps: float):
        out, mean, rstd = torch.native_layer_norm(x, call.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = call.shape
        call.mean, call.rstd = mean, rstd
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx, _, _ = torch.ops.aten.native_layer_norm_backward(dy, x, ctx.shape, mean, rstd,
                                                                 weight, bias, [True, False, False])
        return dx, None, None, None, None


class _DeferredScale(torch.autograd.Function):
    """``x * weight`` whose backward yields the input gradient only (dX = dY * weight)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor):
        ctx.save_for_backward(weight)  # X itself lives in the ScaleCall
        return x * weight

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return (dy * weight if ctx.needs_input_grad[0] else None), None


class _DeferredEmbedding(torch.autograd.Function):
    """`F.embedding` with an empty backward: ids take no gradient and W does the weight."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int,
                scale_grad_by_freq: bool):
        return torch.embedding(weight, ids, padding_idx, scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        return None, None, None, None


# -- recording ---------------------------------------------------------------------------------
def _bind(args: tuple, kwargs: dict, names: tuple[str, ...], defaults: tuple) -> list[Any]:
    """Positional-or-keyword arguments of a functional call, in the order of `names`."""
    bound = list(args) + list(defaults[len(args):])
    return [kwargs.get(n, v) for n, v in zip(names, bound)]


def _record_linear(rec: Recorder, args: tuple, kwargs: dict) -> torch.Tensor | None:
    x, weight, bias = _bind(args, kwargs, ("input", "weight", "bias"), (None, None, None))
    if not rec.owns(weight, bias):
        return None
    x = _cast(x, _autocast_dtype(x))  # [Note: deferred calls under autocast]
    out = _DeferredLinear.apply(x, weight, bias)
    xd = x.detach()
    rec.calls.append(LinearCall(out.grad_fn, xd, xd._version, weight=weight, bias=bias))
    return out


def _record_layer_norm(rec: Recorder, args: tuple, kwargs: dict) -> torch.Tensor | None:
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    x, shape, weight, bias, eps = _bind(args, kwargs, names, (None, None, None, None, 1e-5))
    if not rec.owns(weight, bias):
        return None
    if _autocast_dtype(x) is not None:  # [Note: deferred calls under autocast]
        x = _cast(x, torch.float32 if weight is None else weight.dtype)
    xd = x.detach()
    shape = [shape] if isinstance(shape, int) else list(shape)
    call = LayerNormCall(None, xd, xd._version, shape=shape, weight=weight, bias=bias)
    out = _DeferredLayerNorm.apply(x, weight, bias, call, eps)
    call.node = out.grad_fn
    rec.calls.append(call)
    return out


def _record_embedding(rec: Recorder, args: tuple, kwargs: dict) -> torch.Tensor | None:
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
             "sparse")
    ids, weight, pad, max_norm, _, by_freq, sparse = _bind(
        args, kwargs, names, (None, None, None, None, 2.0, False, False))
    # max_norm renormalizes the weight in place and sparse wants a sparse gradient: both stay
    # with autograd (the generic split)
    if max_norm is not None or sparse or not rec.owns(weight, None):
        return None
    if pad is not None and not -weight.shape[0] <= pad < weight.shape[0]:
        return None  # F.embedding raises its own error
    pad = -1 if pad is None else pad % weight.shape[0]
    out = _DeferredEmbedding.apply(ids, weight, pad, by_freq)
    rec.calls.append(EmbeddingCall(out.grad_fn, ids, ids._version, weight=weight,
                                   padding_idx=pad, scale_grad_by_freq=by_freq))
    return out


def _record_scale(rec: Recorder, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``weight * x`` or ``x * weight`` with a 1-D weight of the stage over x's channels."""
    if len(args) != 2 or kwargs:
        return None
    a, b = args
    weight, x = (a, b) if rec.owns_scale(a) else (b, a) if rec.owns_scale(b) else (None, None)
    if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1
            and x.shape[-1] == weight.shape[0] and x.dtype == weight.dtype):
        return None
    out = _DeferredScale.apply(x, weight)
    xd = x.detach()
    rec.calls.append(ScaleCall(out.grad_fn, xd, xd._version, weight=weight))
    return out


_RECORDERS: dict[Callable, Callable[..., torch.Tensor | None]] = {
    F.linear: _record_linear, F.layer_norm: _record_layer_norm, F.embedding: _record_embedding,
    torch._C.TensorBase.mul: _record_scale, torch.Tensor.__mul__: _record_scale,
    torch.Tensor.__rmul__: _record_scale, torch.mul: _record_scale}


class Recorder(TorchFunctionMode):
    """Active during a stage's forward: routes the stage's linear, layer-norm and embedding
    layers and per-channel scales (an RMSNorm's weight) through their deferred Functions
    (`_RECORDERS`) and records one call for each."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        self._params = {id(p) for p in params if p.requires_grad}
        self.calls: list[DeferredCall] = []

    def owns(self, weight: Any, bias: Any) -> bool:
        """The weight is the stage's, and so is the bias if it takes a gradient at all."""
        if id(weight) not in self._params:
            return False
        return bias is None or id(bias) in self._params or not bias.requires_grad

    def owns_scale(self, value: Any) -> bool:
        """A 1-D parameter of the stage (a norm's per-channel weight)."""
        return isinstance(value, torch.Tensor) and id(value) in self._params and value.dim() == 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        record = _RECORDERS.get(func)
        if record is not None and torch.is_grad_enabled():
            out = record(self, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


# -- the generic split -------------------------------------------------------------------------
def grad_accumulator(param: torch.Tensor) -> Node:
    """The AccumulateGrad node of a leaf (created lazily by autograd, hence the view)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


Consumers = dict[Node, list[tuple[int, torch.nn.Parameter]]]


def consumer_nodes(roots: Sequence[Node], params: Sequence[torch.nn.Parameter],
                   skip: set[Node]) -> Consumers:
    """Nodes of the graph under `roots` that take one of `params` directly, each with
    (position in its next_functions, param) pairs; nodes in `skip` (the deferred calls,
    whose weights W handles itself) are left out."""
    accumulators = {grad_accumulator(p): p for p in params if p.requires_grad}
    consumers: Consumers = {}
    seen: set[Node] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for pos, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            if child in accumulators:
                if node not in skip:
                    consumers.setdefault(node, []).append((pos, accumulators[child]))
            elif child not in seen:
                stack.append(child)
    return consumers


def accumulate(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add `grad` to `param.grad`, in the parameter's dtype (a bf16 dW into an fp32 `.grad`
    [Note: deferred calls under autocast])."""
    if grad is None:
        return
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad.detach().clone() if grad._base is not None else grad.detach()
        else:
            param.grad.add_(grad)


def storages(tensors: Sequence[torch.Tensor | None]) -> dict[int, int]:
    """{storage address: bytes} of `tensors`: a storage shared by several counts once."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if t is not None}


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Active during a stage's forward: notes every storage autograd saves (parameters aside),
    which is what a graph kept from B to W holds."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.saved: dict[int, int] = {}
        skip = {p.untyped_storage().data_ptr() for p in params}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                self.saved[storage.data_ptr()] = storage.nbytes()
            return t

        super().__init__(pack, lambda t: t)


def consumer_weight_grads(node: Node, uses: list[tuple[int, torch.nn.Parameter]],
                          grads: Sequence[torch.Tensor | None], *, shared: bool) -> None:
    """Run one consumer node on the gradients B captured at its outputs and accumulate the
    parts that belong to parameters (`shared`: a parameter of it has other consumers)."""
    if all(g is None for g in grads):
        return  # nothing reached this node from the loss
    if not shared:
        params = list({id(p): p for _, p in uses}.values())
        edges = [GradientEdge(node, k) for k, g in enumerate(grads) if g is not None]
        found = torch.autograd.grad(edges, params, [g for g in grads if g is not None],
                                    retain_graph=True, allow_unused=True)
        for param, grad in zip(params, found):
            accumulate(param, grad)
        return
    full = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
            for g, m in zip(grads, node._input_metadata)]
    call = node if callable(node) else node.apply  # custom Function nodes expose `apply`
    with torch.no_grad():
        out = call(*full)
    out = out if isinstance(out, tuple) else (out,)
    for pos, param in uses:
        grad = out[pos]
        if grad is not None and grad.shape != param.shape:
            # the engine reduces broadcast gradients between nodes; a direct call must do it
            grad = grad.sum_to_size(param.shape)
        accumulate(param, grad)


def edges_of(consumers: Sequence[Node]) -> list[GradientEdge]:
    """One gradient edge per forward output of each consumer: where B captures its grads."""
    return [GradientEdge(node, k) for node in consumers for k in range(len(node._input_metadata))]
