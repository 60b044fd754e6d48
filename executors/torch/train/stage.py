"""`StageRunner`: one pipeline stage's F, B, W and BW for any `torch.nn.Module`.

A schedule may run the ops of different microbatches in any order it likes (F0 F1 B0 F2 W0 ...);
the runner keeps each microbatch's state apart, from its F until its W (or BW), and then frees it.
See [Note: deferred weight gradients] in `executors/torch/train/deferred.py` for how B and W share
one backward pass.

[Note: a fused backward] A schedule that never splits a microbatch's backward (1F1B, GPipe:
every backward is BW) has no use for what the recorder keeps for W, and the recorder is a torch
function mode: it sees every torch call of the forward, a Python call each (`flowkit bench
train` times a stage's F + BW with and without it). So the runtime tells such a forward not to split
(`fused_backward` in the F op's config, flowkit/runner/pipeline.py), and its BW is one plain
autograd pass over the inputs and the parameters, accumulated as W accumulates.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Hashable
from typing import Any

import attrs
import torch
from torch.autograd.graph import GradientEdge

from executors.torch.device import to_device
from executors.torch.errors import StageError
from executors.torch.train.deferred import (
    Consumers,
    DeferredCall,
    Recorder,
    SavedBytes,
    accumulate,
    consumer_nodes,
    consumer_weight_grads,
    edges_of,
    storages,
)
from executors.torch.train.offload import HostStash

__all__ = ["StageRunner"]


@attrs.define(eq=False)
class _Microbatch:
    inputs: tuple[Any, ...]  # as the module saw them: float tensors are grad-requiring leaves
    outputs: tuple[Any, ...]  # attached to the graph; the caller only ever sees detached copies
    calls: list[DeferredCall]  # linear, layer-norm and embedding calls whose W is deferred
    saved: dict[int, int]  # storages autograd saved in the forward: {address: bytes}
    phase: str = "F"  # "F" after the forward, "B" after backward_input
    split: bool = True  # its forward recorded the deferred calls [Note: a fused backward]
    consumers: Consumers = attrs.field(factory=dict)
    consumer_grads: list[torch.Tensor | None] = attrs.field(factory=list)
    stashed_bytes: int = 0
    host: HostStash | None = None  # its forward offloads [Note: offloaded stash]


def _per_input(count: int, indices: list[int], grads: Any) -> tuple[torch.Tensor | None, ...]:
    """The gradients of the inputs at `indices`, None for the others."""
    out: list[torch.Tensor | None] = [None] * count
    for i, g in zip(indices, grads):
        out[i] = g
    return tuple(out)


def _flatten(output: Any) -> tuple[Any, ...]:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def _as_input(value: Any, device: torch.device) -> Any:
    """Float activations become fresh leaves that collect their gradient; ids stay as they are.
    One from the host (another executor's, off the wire) goes to a GPU queued without a wait
    [Note: transfers without a wait in executors/torch/device.py]: a pageable copy would hold
    the host until every kernel queued before it had run."""
    if not isinstance(value, torch.Tensor):
        return value
    value = to_device(value, device)
    return value.detach().requires_grad_(True) if value.is_floating_point() else value


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


class StageRunner:
    """Runs one stage (`module`, already on its device) for many microbatches at once.

    `forward(mb, *inputs)` returns the stage's outputs (detached: the graph stays here);
    `backward_input(mb, *grad_outputs)` returns the input gradients (None where an input has
    none) and stashes what W needs; `backward_weight(mb)` adds the microbatch's parameter
    gradients to `.grad`; `backward(mb, *grad_outputs)` does B and W at once. On the last stage
    the module returns a scalar loss and B takes no grad_outputs.
    """

    def __init__(self, module: torch.nn.Module, *, track_memory: bool = False,
                 autocast: torch.dtype | None = None) -> None:
        self.module = module
        # the forward's compute dtype over the module's own (fp32) weights: bf16 mixed precision
        # [Note: deferred calls under autocast in executors/torch/train/deferred.py]
        self.autocast = autocast
        tensors = [*module.parameters(), *module.buffers()]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._mbs: dict[Hashable, _Microbatch] = {}
        # the most `device_bytes` held after any op, when `track_memory` (it costs a walk over
        # every held tensor per op)
        self.track_memory = track_memory
        self.peak_device_bytes = 0

    def reset(self) -> None:
        """Forget every microbatch in flight and the gradients gathered so far: a step that
        failed part-way is replayed from a checkpoint ([Note: executor restarts] in
        flowkit/runner/checkpoints/restarts.py)."""
        self._mbs.clear()
        for param in self.module.parameters():
            param.grad = None

    # -- public ops ---------------------------------------------------------------------------
    def forward(self, mb: Hashable, *inputs: Any, split: bool = True,
                offload: bool = False) -> Any:
        """The stage's outputs; with `split` False its backward will be BW, one plain
        backward pass [Note: a fused backward]; with `offload` what it stashes goes to host
        memory at once, until `prefetch(mb)` or its backward [Note: offloaded stash]."""
        if mb in self._mbs:
            raise StageError(
                f"forward of microbatch {mb!r} ran twice: its state is still held (phase "
                f"{self._mbs[mb].phase}); run its W or BW before reusing the id")
        leaves = tuple(_as_input(v, self.device) for v in inputs)
        recorder = Recorder(self._params) if split else contextlib.nullcontext()
        if offload:
            stay = [*self.module.buffers(), *(v for v in leaves if isinstance(v, torch.Tensor))]
            saved: SavedBytes | HostStash = HostStash(self.module.parameters(), stay,
                                                      self.device)
        else:
            saved = SavedBytes(self._params)
        with torch.enable_grad(), self._autocast(), recorder, saved:
            output = self.module(*leaves)
        outputs = _flatten(output)
        state = _Microbatch(inputs=leaves, outputs=outputs,
                            calls=recorder.calls if split else [], saved=saved.saved,
                            split=split)
        self._mbs[mb] = state
        if isinstance(saved, HostStash):
            state.host = saved
            saved.keep(o for o in outputs if isinstance(o, torch.Tensor))
            saved.offload((call, name) for call in state.calls
                          for name in ("x", "mean", "rstd") if hasattr(call, name))
        self._noted()
        detached = tuple(_detached(o) for o in outputs)
        return detached if isinstance(output, (tuple, list)) else detached[0]

    def prefetch(self, mb: Hashable) -> None:
        """Start bringing microbatch `mb`'s offloaded activations back to the device (nothing
        for one that did not offload, or is back already) [Note: offloaded stash]."""
        state = self._mbs.get(mb)
        if state is None:
            raise StageError(f"prefetch for microbatch {mb!r}, which has no forward pending on "
                             "this stage; run its forward first")
        if state.host is not None:
            state.host.prefetch()
        self._noted()

    def offloaded(self, mb: Hashable) -> bool:
        """Microbatch `mb`'s activations are in host memory now."""
        state = self._mbs.get(mb)
        return state is not None and state.host is not None and state.host.offloaded

    def backward_input(self, mb: Hashable, *grad_outputs: Any) -> tuple[torch.Tensor | None, ...]:
        state = self._state(mb, "backward_input", expect="F")
        if state.host is not None:
            state.host.wait()
        roots, root_grads = self._roots(mb, state, grad_outputs)
        grad_idx = [i for i, v in enumerate(state.inputs) if _needs_grad(v)]
        consumers = self._consumers(roots, state)
        edges: list[Any] = [state.inputs[i] for i in grad_idx]
        edges += [GradientEdge(c.node, 0) for c in state.calls]
        edges += edges_of(consumers)
        got: tuple[Any, ...] = ()
        if roots and edges:
            # the graph must outlive B only when W will re-enter it at generic consumers
            got = torch.autograd.grad(roots, edges, root_grads, retain_graph=bool(consumers),
                                      allow_unused=True)
        got = got or (None,) * len(edges)
        n_in, n_calls = len(grad_idx), len(state.calls)
        for call, dy in zip(state.calls, got[n_in : n_in + n_calls]):
            call.dy, call.node = dy, None  # the node would keep the graph below it alive
        state.consumers = consumers
        state.consumer_grads = list(got[n_in + n_calls :])
        state.outputs = ()  # W starts from captured gradients, never from the outputs
        state.phase = "B"
        state.stashed_bytes = self._stash_bytes(state)
        grads = _per_input(len(state.inputs), grad_idx, got[:n_in])
        state.inputs = ()
        state.host = None  # the graph is gone or kept for W: stashed_bytes counts what is left
        self._noted()
        return grads

    def backward_weight(self, mb: Hashable, grads_final: Any = None) -> None:
        """W. `grads_final` (the stage's last W of the step, with replicas) is told which
        parameters' gradients are final as each call's are added [Note: all-reduce in the last
        W in executors/torch/train/replicas.py]."""
        state = self._state(mb, "backward_weight", expect="B")
        calls = [c for c in state.calls if c.dy is not None]  # else it did not reach the loss
        finals: list[list[torch.Tensor]] = [[] for _ in calls]
        if grads_final is not None:
            consumed = [p for uses in state.consumers.values() for _, p in uses]
            finals = _finals([c.params() for c in calls] + [consumed])
            grads_final.final_except([p for step in finals for p in step])
        for call, done in zip(calls, finals):
            for param, grad in call.weight_grads():
                accumulate(param, grad)
            if grads_final is not None:
                grads_final.mark_final(done)
        self._consumer_weight_grads(state)
        del self._mbs[mb]
        self._noted()

    def backward(self, mb: Hashable, *grad_outputs: Any,
                 grads_final: Any = None) -> tuple[torch.Tensor | None, ...]:
        """The fused BW op: the same arithmetic as B followed by W, or after a forward that
        did not split, one plain backward pass [Note: a fused backward]; `grads_final` as for
        W, told of each parameter as the pass makes its gradient (the last layers' first)."""
        state = self._mbs.get(mb)
        if state is None or state.split or state.phase != "F":
            grads = self.backward_input(mb, *grad_outputs)
            self.backward_weight(mb, grads_final)
            return grads
        if state.host is not None:
            state.host.wait()
        roots, root_grads = self._roots(mb, state, grad_outputs)
        grad_idx = [i for i, v in enumerate(state.inputs) if _needs_grad(v)]
        targets = [state.inputs[i] for i in grad_idx] + self._params
        got: tuple[Any, ...] = (None,) * len(targets)
        added: set[int] = set()  # the parameters whose gradient a hook added already
        with _telling_final(self._params, grads_final, added):
            if roots:
                got = torch.autograd.grad(roots, targets, root_grads, allow_unused=True)
        for param, grad in zip(self._params, got[len(grad_idx):]):
            if grad is not None and id(param) not in added:
                accumulate(param, grad)
        del self._mbs[mb]
        self._noted()
        return _per_input(len(state.inputs), grad_idx, got[:len(grad_idx)])

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    # -- accounting ---------------------------------------------------------------------------
    @property
    def stashed_bytes(self) -> int:
        """Bytes the stash holds between B and W, over all microbatches (0 once all W ran)."""
        return sum(s.stashed_bytes for s in self._mbs.values())

    @property
    def device_bytes(self) -> int:
        """Activation bytes the microbatches in flight hold on the device now: after F what
        autograd saved, the deferred calls' tensors and the stage's inputs and outputs, less
        what is offloaded to host memory [Note: offloaded stash]; after B what W needs."""
        return sum(self._held_bytes(state) for state in self._mbs.values())

    def _held_bytes(self, state: _Microbatch) -> int:
        if state.phase == "B":
            return state.stashed_bytes
        held = dict(state.host.device_storages()) if state.host is not None else \
            dict(state.saved)
        tensors = [t for c in state.calls for t in c.held()]
        tensors += [t for t in (*state.inputs, *state.outputs) if isinstance(t, torch.Tensor)]
        held.update(storages([t for t in tensors if t is not None and t.device == self.device]))
        return sum(held.values())

    def _noted(self) -> None:
        if self.track_memory:
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    @property
    def pending(self) -> dict[Hashable, str]:
        """Microbatches whose state is held, with the last op that ran for each ("F" or "B")."""
        return {mb: s.phase for mb, s in self._mbs.items()}

    # -- helpers ------------------------------------------------------------------------------
    def _state(self, mb: Hashable, op: str, *, expect: str) -> _Microbatch:
        state = self._mbs.get(mb)
        if state is None:
            held = sorted(map(repr, self._mbs)) or ["none"]
            raise StageError(
                f"{op} for microbatch {mb!r}, which has no forward pending on this stage "
                f"(held: {', '.join(held)}); run its forward first")
        if state.phase != expect:
            why = {"F": "its backward_input already ran; run its backward_weight next",
                   "B": "its backward_input has not run yet; W consumes what B stashes"}[expect]
            raise StageError(f"{op} for microbatch {mb!r} out of order: {why}")
        return state

    def _roots(self, mb: Hashable, state: _Microbatch,
               grad_outputs: tuple[Any, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        outs = state.outputs
        if not grad_outputs:
            if len(outs) != 1 or not isinstance(outs[0], torch.Tensor) or outs[0].numel() != 1:
                raise StageError(
                    f"backward_input for microbatch {mb!r} without grad_outputs needs a scalar "
                    f"loss output (the last stage); this stage returned {len(outs)} output(s)")
            grad_outputs = (torch.ones_like(outs[0]),)
        if len(grad_outputs) != len(outs):
            raise StageError(
                f"backward_input for microbatch {mb!r} got {len(grad_outputs)} grad_outputs "
                f"for {len(outs)} stage outputs")
        pairs = [(o, g) for o, g in zip(outs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        return [o for o, _ in pairs], [g.to(o.device, o.dtype) for o, g in pairs]

    def _consumers(self, roots: list[torch.Tensor], state: _Microbatch) -> Consumers:
        skip = {c.node for c in state.calls}
        return consumer_nodes([r.grad_fn for r in roots], self._params, skip)

    @staticmethod
    def _consumer_weight_grads(state: _Microbatch) -> None:
        """Parameter gradients of the generic consumers, one node run each."""
        users = Counter(id(p) for uses in state.consumers.values() for p in {p for _, p in uses})
        grads = iter(state.consumer_grads)
        for node, uses in state.consumers.items():
            mine = [next(grads) for _ in node._input_metadata]
            shared = any(users[id(p)] > 1 for _, p in uses)
            consumer_weight_grads(node, uses, mine, shared=shared)

    @staticmethod
    def _stash_bytes(state: _Microbatch) -> int:
        """What the deferred calls keep (X, dY, statistics), the gradients captured at
        consumers, and, when there are consumers, the graph B had to keep (what autograd saved
        in the forward)."""
        held = [t for c in state.calls if c.dy is not None for t in c.held()]
        held += state.consumer_grads
        kept = dict(state.saved) if state.consumers else {}
        kept.update(storages(held))
        return sum(kept.values())


def _finals(steps: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """For each step of a W, the parameters no later step adds to: final after it."""
    last = {id(p): index for index, params in enumerate(steps) for p in params}
    return [[p for p in params if last[id(p)] == index] for index, params in enumerate(steps)]


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


@contextlib.contextmanager
def _telling_final(params: list[torch.Tensor], grads_final: Any,
                   added: set[int]) -> Any:
    """Inside, a plain backward pass adds each parameter's gradient as the pass makes it, and
    tells `grads_final` it is final, so its bucket's all-reduce may start while the pass goes
    on [Note: all-reduce in the last W in executors/torch/train/replicas.py]; the ids of those
    added go to `added`. A leaf's hook sees its whole gradient once, however often it is used."""
    if grads_final is None:
        yield
        return

    def hook_of(param: torch.Tensor) -> Any:
        def final(grad: torch.Tensor) -> torch.Tensor:
            accumulate(param, grad)
            added.add(id(param))
            grads_final.mark_final([param])
            return grad
        return final

    handles = [p.register_hook(hook_of(p)) for p in params if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
