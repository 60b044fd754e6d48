"""A step's per-item calls sent as batched tasks, and their answers taken in: the part of a
`StepRun` (steprun.py) that decides how ready items go out.

[Note: batched per-item calls] A per-item op's ready items go out together: everything that is
ready when the node is looked at, up to BATCH_ITEMS a task and spread over the executors that
run the op, as batched tasks ([Note: batched tasks] in flowkit/wire/task.py), each answered by
one completion and handled by one reaction. Reactions only mark the nodes they touch; the run
looks at those once the reactions queued so far have run (`progress_touched`). A node keeps at most
_BATCHES_IN_FLIGHT of its tasks per executor able to run it on the way: ready items beyond
that wait (`held`) until one of its tasks ends, and then go together (adaptive batching, as an
inference server's dynamic batcher does). So the first finished sample goes downstream at once,
and under load the items that come meanwhile coalesce into as few tasks as the executors can
take, rather than into as many as the controller happens to react. Calls whose items stream,
are balanced or have a call policy stay one task each.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from flowkit.planner.lower import NodePlan
from flowkit.runner.stepstate import FlowRunError, NodeState

__all__ = ["BATCH_ITEMS", "ItemBatching"]

# [Note: batched per-item calls]: at most this many items a task, and a burst of ready items is
# spread over the executors in tasks of at least _SPLIT_ITEMS
BATCH_ITEMS, _SPLIT_ITEMS = 256, 16
_BATCHES_IN_FLIGHT = 2  # a node's tasks on the way per executor before its ready items wait


class ItemBatching:
    """How step `run`'s (a StepRun's) ready per-item calls go out: held, batched or one by one
    [Note: batched per-item calls]."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._able: dict[str, int] = {}  # node -> executors that run its op

    def send_ready(self, state: NodeState, ready: list[tuple[tuple, dict]],
                    varying: list[str]) -> None:
        """Calls (lineage, refs) that are ready, with those held before, as batched tasks, or
        held until one of the node's tasks ends if enough are on the way [Note: batched
        per-item calls]; `varying`: the ports whose refs differ from call to call."""
        if state.held:
            ready, state.held = state.held + ready, []
        if not ready:
            return
        state.varying = varying
        cap = self.run.lending.fill_cap(state.plan)
        if cap:  # [Note: bubble filling in bubble_fill.py]: what waits, a bubble may take
            own = state.pending - state.lent  # the tasks on its own executors
            room = max(0, _BATCHES_IN_FLIGHT * self.able_count(state.plan) - own)
            sent = min(len(ready), room * cap)
            for begin in range(0, sent, cap):
                self.submit_chunk(state, ready[begin:begin + cap], varying)
            state.held = ready[sent:]
            if state.held:
                self.run.submission.bubble_fill.waiting_items()
            return
        if state.pending >= _BATCHES_IN_FLIGHT * self.able_count(state.plan):
            state.held = ready
        elif len(ready) > 1:
            self._batches(state, ready, varying)
        else:
            self.run.submit(state, *ready[0])

    def _batches(self, state: NodeState, ready: list[tuple[tuple, dict]],
                        varying: list[str]) -> None:
        """`ready` (lineage, refs) as batched tasks, spread over the executors that run the op
        [Note: batched per-item calls]."""
        plan = state.plan
        able = self.able_count(plan)
        count = len(ready)
        pieces = max(math.ceil(count / BATCH_ITEMS), min(able, count // _SPLIT_ITEMS), 1)
        size = math.ceil(count / pieces)
        for begin in range(0, count, size):
            self.submit_chunk(state, ready[begin:begin + size], varying)

    def submit_chunk(self, state: NodeState, chunk: list[tuple[tuple, dict]],
                      varying: list[str], executor: int | None = None) -> Any:
        """Calls (lineage, refs) as one task, batched unless there is one; the future that
        ends it."""
        if len(chunk) == 1:
            return self.run.submit(state, *chunk[0], executor=executor)
        refs = {port: ref for port, ref in chunk[0][1].items() if port not in varying}
        refs.update({port: [item_refs[port] for _, item_refs in chunk] for port in varying})
        return self._batch(state, [lineage for lineage, _ in chunk], refs, varying,
                                  executor=executor)

    def _batch(self, state: NodeState, lineages: list[tuple], refs: dict[str, Any],
                      varying: list[str], executor: int | None = None) -> Any:
        """One batched task of `lineages`' calls; `refs` holds a list of their refs for each
        port in `varying`, and the refs every call shares for the others."""
        plan, run = state.plan, self.run
        refs.update(run.feedback.refs(plan, run.step))
        ports = [rule.port for rule in plan.inputs if rule.port in refs]
        outputs = max(1, len(plan.outputs))
        batch, events = _Batch(lineages), run.submission.events
        futures = run.submission.ctl.submit_items(
            plan.op, *(refs[p] for p in ports),
            per_item=[j for j, port in enumerate(ports) if port in varying],
            config=self.run.config(plan, (), None, ports), tags=plan.tags, outputs=outputs,
            executor=executor,
            meta={"node": plan.name, "step": self.run.step, "batch_items": len(lineages)},
            report_key=self.run.wiring.report_keys.get(plan.name), trace_key=plan.trace_key,
            on_items=lambda early: events.put(
                functools.partial(self._on_items, plan.name, batch, *early)))
        batch.outputs = [f if outputs > 1 else (f,) for f in futures]
        state.pending += 1
        # the last item's future: when it is done, every item's is (or failed with it)
        batch.outputs[-1][0].add_done_callback(lambda _: events.put(
            functools.partial(self._on_done, plan.name, batch)))
        return batch.outputs[-1][0]

    def _on_items(self, name: str, batch: _Batch, first: int, count: int) -> None:
        """Items a batched task finished early ([Note: early items] in executors/process.py):
        into the node's streams now, so a slow item holds back no other."""
        if first != batch.registered:
            return  # answered out of order, which the dispatcher refuses: the end brings them
        start, _ = batch.outputs[first][0].timing
        state = self.run.states[name]
        state.first_start = min(start, state.first_start or start)
        self._register(state, batch, first + count)

    def _on_done(self, name: str, batch: _Batch) -> None:
        """A batched task is done: its items not yet in, into the node's streams."""
        state = self.run.states[name]
        state.pending -= 1
        last = batch.outputs[-1][0]
        error = last.exception()
        if error is not None:
            raise FlowRunError(f"step {self.run.step}: op {name!r} failed: {error}") from error
        start, end = last.timing
        state.first_start = min(start, state.first_start or start)
        state.last_end = max(end, state.last_end or end)
        fill = self.run.submission.bubble_fill
        if fill is not None and state.plan.scores:
            fill.learn(name, end - start, len(batch.lineages))
        self._register(state, batch, len(batch.lineages))

    def _register(self, state: NodeState, batch: _Batch, upto: int) -> None:
        """A batch's items not yet in the node's streams, up to item `upto`, into them."""
        for i in range(batch.registered, upto):
            self.run.register_outputs(state.plan, batch.lineages[i], batch.outputs[i])
        batch.registered = upto
        self.run.touch(state.plan.name)

    def able_count(self, plan: NodePlan) -> int:
        """How many executors run `plan`'s op (looked up once a node)."""
        able = self._able.get(plan.name)
        if able is None:
            tags = frozenset(plan.tags)
            able = self._able[plan.name] = max(1, sum(
                1 for e in self.run.submission.ctl.executors() if e.runs(plan.op, tags)))
        return able


class _Batch:
    """A batched task's calls as the step handles them: their lineages, each one's output
    futures, and how many are in the node's streams already (answered early, in order)."""

    __slots__ = ("lineages", "outputs", "registered")

    def __init__(self, lineages: list[tuple]) -> None:
        self.lineages, self.outputs, self.registered = lineages, [], 0
