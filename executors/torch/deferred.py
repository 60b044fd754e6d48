"""How B leaves weight gradients for W without running anything twice.

[Note: deferred weight gradients]
B (`StageRunner.backward_input`) and W (`StageRunner.backward_weight`) split one backward pass:

- Linear layers. While a stage runs its forward, every `F.linear` whose weight is a parameter of
  the stage goes through `_DeferredLinear`, whose backward computes only dX = dY·W. The recorder
  keeps the layer input X (a detached alias: the forward already holds it, no copy); B captures
  dY at the node's gradient edge, and W computes dW = dYᵀX and db = ΣdY from the pair.
- Any other parameter (LayerNorm, Embedding, convolutions, a user's own `nn.Parameter`). B also
  captures the gradient flowing into each autograd node that takes such a parameter directly
  (its "consumer") and keeps the graph; W runs each consumer node once on its captured gradient
  and keeps the parameter parts. This is the split `torch.distributed.pipelining` makes in
  `stage_backward_input/weight`, taken at the consumer nodes so that a stage without float
  inputs (the embedding stage) splits as well, and so that W never walks the chain between two
  consumers. A node whose parameters no other consumer uses (the usual case) runs through the
  autograd engine with only its parameters as targets, so it computes the weight part alone; a
  node sharing a parameter with another consumer (one parameter used twice on a path) is called
  directly, since the engine would walk down to the other use and count it twice: that call
  recomputes the node's own input gradient, never a chain of them.

Neither half re-runs the forward, and the sum of what W accumulates over all consumers and
linear calls is the ordinary gradient: every path from the loss to a parameter ends in exactly
one edge from a consumer node or in a linear call, and B captured the total gradient entering
each of those nodes. Tied weights (one parameter used by an embedding and by a
linear head) simply receive both contributions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, Node
from torch.overrides import TorchFunctionMode

__all__ = [
    "LinearCall",
    "Recorder",
    "Consumers",
    "SavedBytes",
    "accumulate",
    "consumer_nodes",
    "consumer_weight_grads",
    "edges_of",
    "grad_accumulator",
    "linear_weight_grads",
    "storages",
]


@attrs.define(eq=False)
class LinearCall:
    """One deferred `F.linear` of a microbatch: what W needs to compute its weight gradient."""

    node: Node | None  # the `_DeferredLinear` backward node; B captures dY at its edge 0
    x: torch.Tensor  # layer input, detached alias of the forward's own tensor
    x_version: int  # in-place edits of X after the forward would make dW silently wrong
    weight: torch.nn.Parameter
    bias: torch.Tensor | None
    dy: torch.Tensor | None = None  # set by B


class _DeferredLinear(torch.autograd.Function):
    """`F.linear` whose backward yields the input gradient only; W does the weight part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(weight)  # dX needs W only; X itself lives in the LinearCall
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        dx = dy.reshape(-1, dy.shape[-1]).mm(weight)  # (N, out) @ (out, in): one BLAS call
        return dx.view(*dy.shape[:-1], weight.shape[-1]), None, None


def _linear_args(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    bound = list(args) + [None] * (3 - len(args))
    x = kwargs.get("input", bound[0])
    weight = kwargs.get("weight", bound[1])
    bias = kwargs.get("bias", bound[2])
    return x, weight, bias


class Recorder(TorchFunctionMode):
    """Active during a stage's forward: routes the stage's linear layers through
    `_DeferredLinear` and records one `LinearCall` per call."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        self._params = {id(p) for p in params if p.requires_grad}
        self.calls: list[LinearCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, bias = _linear_args(args, kwargs)
            if id(weight) in self._params:
                out = _DeferredLinear.apply(x, weight, bias)
                xd = x.detach()
                self.calls.append(LinearCall(out.grad_fn, xd, xd._version, weight, bias))
                return out
        return func(*args, **kwargs)


def grad_accumulator(param: torch.Tensor) -> Node:
    """The AccumulateGrad node of a leaf (created lazily by autograd, hence the view)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


Consumers = dict[Node, list[tuple[int, torch.nn.Parameter]]]


def consumer_nodes(
    roots: Sequence[Node], params: Sequence[torch.nn.Parameter], skip: set[Node]
) -> Consumers:
    """Nodes of the graph under `roots` that take one of `params` directly, each with
    (position in its next_functions, param) pairs; nodes in `skip` (the deferred linears,
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


def linear_weight_grads(call: LinearCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dW = dYᵀX and db = ΣdY, summed over every leading (batch, time) dimension."""
    if call.x._version != call.x_version:
        raise RuntimeError(
            "the input of a linear layer was modified in place after the forward; deferred "
            "weight gradients need it unchanged (use an out-of-place op in the model)"
        )
    dy = call.dy.reshape(-1, call.dy.shape[-1])  # (N, out)
    x = call.x.reshape(-1, call.x.shape[-1])  # (N, in)
    dw = dy.t().matmul(x.to(dy.dtype))  # (out, in)
    db = dy.sum(0) if call.bias is not None and call.bias.requires_grad else None
    return dw, db


def accumulate(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad.detach().clone() if grad._base is not None else grad.detach()
        else:
            param.grad.add_(grad)


def storages(tensors: Sequence[torch.Tensor | None]) -> dict[int, int]:
    """{storage address: bytes} of `tensors`: a storage shared by several counts once."""
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t is not None
    }


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


def consumer_weight_grads(
    node: Node,
    uses: list[tuple[int, torch.nn.Parameter]],
    grads: Sequence[torch.Tensor | None],
    *,
    shared: bool,
) -> None:
    """Run one consumer node on the gradients B captured at its outputs and accumulate the
    parts that belong to parameters (`shared`: a parameter of it has other consumers)."""
    if all(g is None for g in grads):
        return  # nothing reached this node from the loss
    if not shared:
        params = list({id(p): p for _, p in uses}.values())
        edges = [GradientEdge(node, k) for k, g in enumerate(grads) if g is not None]
        found = torch.autograd.grad(
            edges, params, [g for g in grads if g is not None], retain_graph=True,
            allow_unused=True,
        )
        for param, grad in zip(params, found):
            accumulate(param, grad)
        return
    full = [
        g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
        for g, m in zip(grads, node._input_metadata)
    ]
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
